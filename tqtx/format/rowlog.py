"""The row log's files: entries and file names (the unit that writes and replays them is
:mod:`tqtx.storage.rowlog`; docs/reliability.md, *The row log*).

A unit's data directory holds ``seg-<n>.log`` (entries in the order the unit applied them),
``base-<n>.log`` (every live row when segment ``n`` was opened), ``base-<n>.tmp`` (a base
being written) and ``lock``. An entry is::

    b"TQLE" kind:u8 index:i64 generation:i64 length:u32 crc:u32   then `length` bytes of body

with ``crc`` the CRC-32C of the body:

``ROW``    a record of the dump format (:mod:`tqtx.format.records`): the fields stored at
           ``index`` as ``generation`` (merged into a row of that generation, replacing an
           older one)
``DROP``   msgpack ``[[index, ...], [generation, ...]]``: those rows were dropped
``RESET``  empty: every row went (a checkpoint's rows follow as ``ROW`` entries)
``MARK``   msgpack ``[what, id, rows]``: the unit applied restore ``id`` (``what`` is
           ``"restore"``) or switched to checkpoint load ``id`` (``"checkpoint"``), of
           ``rows`` rows, after the entries before it; replayed, a unit still knows it did
           (a roll-forward after a restart does not apply it again over later writes)

A file is read entry by entry up to the first one that is cut short or does not match its
CRC: a crash in the middle of a write leaves such a tail, and nothing after it is trusted.
"""
from __future__ import annotations

import re
import struct

from tqtx.format.records import RecordEncoder, checksum, decode_record, encode_record_parts
from tqtx.wire import codec

ROW, DROP, RESET, MARK = 1, 2, 3, 4
KINDS = (ROW, DROP, RESET, MARK)
MARK_RESTORE, MARK_CHECKPOINT = "restore", "checkpoint"
ENTRY = struct.Struct("<4sBqqII")
MAGIC = b"TQLE"
SEGMENT, BASE = "seg", "base"
_NAME = re.compile(r"^(seg|base)-(\d{8})\.(log|tmp)$")


def file_name(kind: str, number: int, *, tmp: bool = False) -> str:
    """``seg-<n>.log``, ``base-<n>.log`` or ``base-<n>.tmp``."""
    return f"{kind}-{number:08d}.{'tmp' if tmp else 'log'}"


def parse_name(name: str) -> tuple[str, int, bool] | None:
    """``(kind, number, tmp)`` of a row log file name; None for any other name."""
    m = _NAME.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3) == "tmp")


def replay_order(files: list[tuple[str, int]], below: int | None = None) -> list[tuple[str, int]]:
    """Of a log's files ``(kind, number)``, those that hold it, in replay order: the newest
    base and the segments from its number on (only files numbered below ``below``)."""
    if below is not None:
        files = [(k, n) for k, n in files if n < below]
    bases = [n for k, n in files if k == BASE]
    start = max(bases) if bases else 0
    return ([(BASE, start)] if bases else []) + \
        sorted((k, n) for k, n in files if k == SEGMENT and n >= start)


def encode_row(idx: int, gen: int, values: dict, encoder: RecordEncoder) -> tuple[list, int]:
    """``(buffers, size)`` of the ``ROW`` entry of ``values`` at ``idx`` as ``gen`` (large
    tensor payloads are the values' own buffers). TypeError/ValueError for a value the
    record format cannot hold."""
    head, large, length = encode_record_parts(idx, values, encoder, gen=gen, partition_id="",
                                              key="")
    crc = checksum(head)
    for buf in large:
        crc = checksum(buf, crc)
    return [ENTRY.pack(MAGIC, ROW, idx, gen, length, crc), head, *large], ENTRY.size + length


def encode_drop(indexes: list[int], gens: list[int]) -> tuple[list, int]:
    """``(buffers, size)`` of the ``DROP`` entry of those rows."""
    body = codec.packb([list(indexes), list(gens)])
    return [ENTRY.pack(MAGIC, DROP, 0, 0, len(body), checksum(body)), body], \
        ENTRY.size + len(body)


def encode_reset() -> tuple[list, int]:
    """``(buffers, size)`` of a ``RESET`` entry."""
    return [ENTRY.pack(MAGIC, RESET, 0, 0, 0, checksum(b""))], ENTRY.size


def encode_mark(what: str, ident: str, rows: int) -> tuple[list, int]:
    """``(buffers, size)`` of the ``MARK`` entry of an applied restore or checkpoint load."""
    body = codec.packb([what, ident, int(rows)])
    return [ENTRY.pack(MAGIC, MARK, 0, 0, len(body), checksum(body)), body], \
        ENTRY.size + len(body)


class EntryReader:
    """The whole entries of a file's bytes ``view`` (``size`` of them), in order:
    iterate for ``(kind, index, generation, body)``; ``end`` is then the offset after the
    last whole entry (``size`` unless the file has a torn or corrupt tail)."""

    def __init__(self, view, size: int):
        self.view, self.size, self.end = view, size, 0

    def __iter__(self):
        view, size, head = self.view, self.size, ENTRY.size
        pos = 0
        while pos + head <= size:
            magic, kind, idx, gen, length, crc = ENTRY.unpack_from(view, pos)
            end = pos + head + length
            if magic != MAGIC or kind not in KINDS or end > size:
                break
            body = view[pos + head:end]
            if checksum(body) != crc:
                break
            self.end = end
            yield kind, idx, gen, body
            body.release()
            pos = end


def decode_row(body, idx: int, where: str) -> dict:
    """The field values of a ``ROW`` entry's body (views of ``body`` for large tensors)."""
    return decode_record(body, expected_gidx=idx, where=where)[1]


def decode_drop(body) -> tuple[list[int], list[int]]:
    """The indexes and generations of a ``DROP`` entry's body."""
    indexes, gens = codec.unpackb(bytes(body))
    return indexes, gens


def decode_mark(body) -> tuple[str, str, int]:
    """``(what, id, rows)`` of a ``MARK`` entry's body."""
    what, ident, rows = codec.unpackb(bytes(body))
    if what not in (MARK_RESTORE, MARK_CHECKPOINT):
        raise ValueError(f"row log mark of unknown kind {what!r}")
    return what, ident, int(rows)
