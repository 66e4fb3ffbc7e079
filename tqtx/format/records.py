"""Records: one row of a dump shard as a self-contained byte string.

A record is ``b"TQR2" + uint32_le(header_len) + header + payload`` where the header is
``{"i": global_index, "g": generation, "p": partition_id, "k": key, "f": {field: ["t",
dtype, shape, rel_offset, nbytes] | ["o", packed_object]}}`` (msgpack; objects are
:func:`tqtx.wire.codec.packb` bytes) and tensor payloads follow the header. A record's crc32
is a CRC-32C (Castagnoli) of all its bytes. The partition, key and generation name the row
the record was written from (the row fence, docs/data_dump.md): readers check them against
the row index, so a record of another key is refused, naming it. Records of format version 1
(``b"TQR1"``, header ``{"i", "f"}``) name no key and are still read.
"""
from __future__ import annotations

import struct

import msgpack
from crc32c import crc32c as checksum  # CRC-32C (Castagnoli), hardware-accelerated

from tqtx.errors import DumpFormatError, DumpNotFoundError
from tqtx.wire import codec
from tqtx.wire.values import DTYPE_NAMES, DTYPE_SIZES, RawTensor, shared_shape

__all__ = ["PREFIX_SIZE", "RECORD_MAGIC", "RecordEncoder", "checksum", "decode_record",
           "encode_record", "encode_record_parts", "file_error", "is_int"]

RECORD_MAGIC = b"TQR2"
RECORD_MAGIC_V1 = b"TQR1"  # records without partition, key and generation
_PREFIX = struct.Struct("<4sI")
PREFIX_SIZE = _PREFIX.size  # 8: magic + header length

# Tensor payloads up to this size are copied next to the header (one iovec per record
# instead of one per field); larger ones are handed to writev as they are.
_SMALL_PAYLOAD = 4096
# Small payloads are joined into the record's first buffer only up to this many bytes in
# all; above it they are handed to writev as they are too (their place in the record
# stays the same).
_JOIN_SMALL = 1024

# A decoded field is a view of its record (no copy), but a view is an object of 184 bytes
# that lives as long as the row: a payload no larger than that is cheaper copied out.
_COPY_BELOW = 184

_tensor_of = RawTensor.of  # skips RawTensor.__init__'s shape conversion for checked headers


def is_int(x) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def file_error(file, msg: str, *, global_index=None, key=None,
               missing=False) -> DumpFormatError:
    """A DumpFormatError whose message starts with ``file``; details kept as attributes.
    ``missing``: a DumpNotFoundError (also a FileNotFoundError) naming ``file``."""
    exc = DumpNotFoundError(f"{file}: {msg}", file) if missing else DumpFormatError(f"{file}: {msg}")
    exc.file = str(file)
    exc.global_index = global_index
    exc.key = key
    return exc


def _nbytes(tensor: RawTensor, gidx, name) -> int:
    """The bytes the tensor's dtype and shape make; ValueError for an unknown dtype or a
    negative dimension."""
    dtype = tensor.dtype
    n = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if n is None:
        raise ValueError(f"global index {gidx}, field {name!r}: unknown dtype {dtype!r}")
    for s in tensor.shape:
        if s < 0:
            raise ValueError(f"global index {gidx}, field {name!r}: negative dimension in "
                             f"shape {list(tensor.shape)}")
        n *= s
    return n


def _payload(tensor: RawTensor, gidx, name):
    """``(buffer, nbytes)`` of exactly the tensor's bytes; bytes or a 1-D byte memoryview."""
    expected = _nbytes(tensor, gidx, name)
    data = tensor.data
    if type(data) is bytes:
        n = len(data)
    else:
        data = memoryview(data)
        if not data.c_contiguous:
            data = memoryview(data.tobytes())
        if data.ndim != 1 or data.format != "B":
            data = data.cast("B")
        n = data.nbytes
    if n != expected:
        raise ValueError(
            f"global index {gidx}, field {name!r}: {n} bytes for dtype {tensor.dtype} "
            f"shape {list(tensor.shape)} (expected {expected})")
    return data, n


# Header pieces, so a record's header is built by joining bytes rather than by packing a
# fresh dict per row: {"i": gidx, "g": gen, "p": pid, "k": key, "f": {...}} packs as these
# constants around the parts.
_HEAD_I = b"\x85\xa1i"  # fixmap(5), "i"
_HEAD_G = b"\xa1g"
_HEAD_P = b"\xa1p"
_HEAD_K = b"\xa1k"
_HEAD_F = b"\xa1f"  # "f"
_FIXMAP = [bytes([0x80 | n]) for n in range(16)]
_TENSOR_SPEC = b"\x95\xa1t"  # ["t", ... (5 items)
_OBJECT_SPEC = b"\x92\xa1o"  # ["o", ... (2 items)
_FIELD_CACHE_MAX = 1 << 14
_JAGGED_AFTER = 16  # layouts of a field missing the cache before it counts as jagged


class RecordEncoder:
    """Encodes records with one msgpack Packer and a cache of the checked tensor field
    layouts seen so far, ``(name, dtype, shape) -> (the field's header bytes up to its
    offset, nbytes, packed nbytes)``: rows of one layout skip the checks and the packing.
    A field whose layouts missed the cache :data:`_JAGGED_AFTER` times (a jagged field,
    whose shapes seldom come back) is ``jagged``: rows with one are packed as a dict
    (:func:`_encode_by_dict`), which costs less than building cache entries never used.
    One per writer and thread; the cache goes with it (a dump's layouts are not kept).
    ``(name, dtype)`` keys hold the packed name and dtype of new shapes."""

    __slots__ = ("pack", "fields", "misses", "jagged", "partition")

    def __init__(self):
        self.pack = codec.packer()
        self.fields: dict = {}
        self.misses: dict = {}  # field name -> layouts of it that missed the cache
        self.jagged: set = set()
        self.partition: tuple = (None, b"")  # the last partition ID and its packed form


def _tensor_field(name, value: RawTensor, gidx, pack, cache) -> tuple[bytes, int, bytes]:
    """Check a tensor field's name, dtype and shape; its header bytes up to the offset."""
    known = cache.get((name, value.dtype)) if type(value.dtype) is str else None
    if known is None and type(name) is not str:
        raise TypeError(f"global index {gidx}: field names must be str, not {name!r}")
    n = _nbytes(value, gidx, name)
    if known is None:
        known = cache[(name, value.dtype)] = pack(name) + _TENSOR_SPEC + pack(value.dtype)
    return known + pack(list(value.shape)), n, pack(n)


def _check_names(gen, pid, key, gidx) -> None:
    if not is_int(gen) or type(key) is not str or type(pid) is not str:
        raise TypeError(f"global index {gidx}: a record names its row by an int generation "
                        f"and str partition and key, got {gen!r}, {pid!r}, {key!r}")


def _ident_parts(gen, pid, key, encoder: RecordEncoder, gidx) -> list:
    """The header pieces naming the row: ``"g"``, ``"p"`` and ``"k"`` with their values."""
    _check_names(gen, pid, key, gidx)
    pack = encoder.pack
    last, packed = encoder.partition
    if pid is not last:
        packed = pack(pid)
        encoder.partition = (pid, packed)
    return [_HEAD_G, pack(gen), _HEAD_P, packed, _HEAD_K, pack(key)]


def _exact_payload(value: RawTensor, n: int, gidx, name):
    """The tensor's ``n`` bytes as bytes or a 1-D byte memoryview (no copy), or the error."""
    data = value.data
    if type(data) is bytes:
        if len(data) == n:
            return data
    else:
        if type(data) is not memoryview:
            data = memoryview(data)  # e.g. the zmq frame a put stored
        if data.nbytes == n and data.ndim == 1 and data.format == "B" and data.c_contiguous:
            return data
    return _payload(value, gidx, name)[0]  # a 1-D byte view, or the error


def _record(gidx, header: bytes, small_parts: list, small_total: int, large: list,
            large_off: int) -> tuple[bytes, list, int]:
    """``(head, large payloads, length)`` of a record of ``header`` and its payloads."""
    if len(header) > 0xFFFFFFFF:
        raise ValueError(f"global index {gidx}: record header too large ({len(header)} bytes)")
    prefix = _PREFIX.pack(RECORD_MAGIC, len(header))
    length = len(prefix) + len(header) + large_off
    if small_total <= _JOIN_SMALL:
        return b"".join([prefix, header, *small_parts]), large, length
    # copying kilobytes per row costs more than an iovec per payload
    return prefix + header, small_parts + large, length


def _encode_by_dict(gidx: int, row: dict, encoder: RecordEncoder, gen: int,
                    partition_id: str, key: str) -> tuple[bytes, list, int]:
    """:func:`encode_record_parts` of a row with a field layout not cached: the header as
    one dict packed in one call (msgpack's C packer does in it what joining packed pieces
    costs more for in Python: a rollout row 4.8 against 6.1 µs), nothing cached."""
    _check_names(gen, partition_id, key, gidx)
    pack = encoder.pack
    specs = {}  # the header's "f", in row order; a tensor's offset is set below
    tensors = []  # (its spec, nbytes, payload)
    small_total = 0
    for name, value in row.items():
        if type(name) is not str:
            raise TypeError(f"global index {gidx}: field names must be str, not {name!r}")
        if not isinstance(value, RawTensor):
            specs[name] = ["o", pack(value)]
            continue
        n = _nbytes(value, gidx, name)
        data = _exact_payload(value, n, gidx, name)
        spec = specs[name] = ["t", value.dtype, value.shape, 0, n]
        if n <= _SMALL_PAYLOAD:
            small_total += n
        tensors.append((spec, n, data))
    # Small payloads go first, joined with the header; large ones follow as their own iovecs.
    small_parts = []
    large = []
    small_off, large_off = 0, small_total
    for spec, n, data in tensors:
        if n <= _SMALL_PAYLOAD:
            spec[3] = small_off
            small_off += n
            if n:
                small_parts.append(data)
        else:
            spec[3] = large_off
            large_off += n
            large.append(data)
    header = pack({"i": gidx, "g": gen, "p": partition_id, "k": key, "f": specs})
    return _record(gidx, header, small_parts, small_total, large, large_off)


def encode_record_parts(gidx: int, row: dict, encoder: RecordEncoder | None = None, *,
                        gen: int, partition_id: str, key: str) -> tuple[bytes, list, int]:
    """Encode one row as ``(head, large_payloads, length)`` without a checksum.

    ``head`` is the prefix and header (small payloads joined to it when they are few
    bytes); ``large_payloads`` are the rest of the record, the row's own buffers.
    ``encoder``: a :class:`RecordEncoder` to reuse (batch callers); ``gen``,
    ``partition_id``, ``key``: the row the record names. Raises ValueError/TypeError for
    values that cannot be stored.
    """
    if type(gidx) is not int:
        if not is_int(gidx):
            raise TypeError(f"global index must be an int, not {type(gidx).__name__}")
        gidx = int(gidx)
    if encoder is None:
        encoder = RecordEncoder()
    if encoder.jagged and not encoder.jagged.isdisjoint(row):
        return _encode_by_dict(gidx, row, encoder, gen, partition_id, key)
    pack, cache = encoder.pack, encoder.fields
    fields = []  # in row order: (cache entry, payload) of a tensor, (header bytes, None) else
    small_total = 0
    for name, value in row.items():
        if isinstance(value, RawTensor):
            try:  # a miss is common (jagged rows' shapes vary): no KeyError raised for it
                ent = cache.get((name, value.dtype, value.shape))
            except TypeError:  # an unhashable shape
                ent = None
            if ent is None:
                ent = _tensor_field(name, value, gidx, pack, cache)
                if type(value.shape) is tuple and type(value.dtype) is str:
                    if len(cache) >= _FIELD_CACHE_MAX:
                        cache.clear()
                    cache[(name, value.dtype, value.shape)] = ent
                missed = encoder.misses[name] = encoder.misses.get(name, 0) + 1
                if missed == _JAGGED_AFTER:  # (_tensor_field checked the name)
                    encoder.jagged.add(name)
            data = value.data  # the usual case checked inline: a 1-D byte view of the row
            if type(data) is not memoryview or data.nbytes != ent[1] or data.ndim != 1 \
                    or data.format != "B" or not data.c_contiguous:
                data = _exact_payload(value, ent[1], gidx, name)
            if ent[1] <= _SMALL_PAYLOAD:
                small_total += ent[1]
            fields.append((ent, data))
        elif type(name) is not str:
            raise TypeError(f"global index {gidx}: field names must be str, not {name!r}")
        else:
            fields.append((b"".join([pack(name), _OBJECT_SPEC, pack(pack(value))]), None))
    nf = len(fields)
    hparts = [_HEAD_I, pack(gidx), *_ident_parts(gen, partition_id, key, encoder, gidx),
              _HEAD_F, _FIXMAP[nf] if nf < 16 else msgpack.Packer().pack_map_header(nf)]
    # Small payloads go first, joined with the header; large ones follow as their own iovecs.
    small_parts = []
    large = []
    small_off, large_off = 0, small_total
    for ent, data in fields:
        if data is None:
            hparts.append(ent)
            continue
        pre, n, packed_n = ent
        if n <= _SMALL_PAYLOAD:
            hparts += (pre, pack(small_off), packed_n)
            small_off += n
            if n:
                small_parts.append(data)
        else:
            hparts += (pre, pack(large_off), packed_n)
            large_off += n
            large.append(data)
    header = b"".join(hparts)
    return _record(gidx, header, small_parts, small_total, large, large_off)


def encode_record(gidx: int, row: dict, *, gen: int, partition_id: str,
                  key: str) -> tuple[list, int, int]:
    """Encode one row as a record: ``(buffers, length, crc32)``.

    ``buffers`` concatenated form the record; large tensor payloads are the row's own
    buffers (only the bytes of each tensor, never the larger buffer they may slice).
    Raises ValueError/TypeError for values that cannot be stored.
    """
    head, large, length = encode_record_parts(gidx, row, gen=gen, partition_id=partition_id,
                                              key=key)
    crc = checksum(head)
    for buf in large:
        crc = checksum(buf, crc)
    return [head, *large], length, crc


def _bad(where, msg):
    return DumpFormatError(f"{where}: {msg}")


def _header_fields(specs: dict, where) -> tuple[dict, list]:
    """Objects decoded and tensor entries checked: ``(row, ranges)``, where ``row`` has
    every field in header order (tensors still None) and ``ranges`` lists
    ``(offset, nbytes, name, dtype, shape)`` per tensor."""
    row: dict = {}
    ranges = []
    for name, spec in specs.items():
        if type(name) is not str or type(spec) is not list or not spec:
            raise _bad(where, f"malformed entry for field {name!r}")
        kind = spec[0]
        if kind == "t":
            if len(spec) != 5:
                raise _bad(where, f"malformed tensor entry for field {name!r}")
            _, dtype, shape, off, n = spec
            size = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
            if size is None:
                raise _bad(where, f"field {name!r} has unknown dtype {dtype!r}")
            if type(shape) is not list or type(off) is not int or type(n) is not int or off < 0:
                raise _bad(where, f"malformed tensor entry for field {name!r}")
            expected = size
            for s in shape:
                if type(s) is not int or s < 0:
                    raise _bad(where, f"field {name!r} has invalid shape {shape!r}")
                expected *= s
            if n != expected:
                raise _bad(where, f"field {name!r}: {n} bytes for dtype {dtype} shape {shape}")
            ranges.append((off, n, name, dtype, shape))
            row[name] = None  # keeps the header's field order
        elif kind == "o":
            if len(spec) != 2 or type(spec[1]) is not bytes:
                raise _bad(where, f"malformed object entry for field {name!r}")
            try:
                row[name] = codec.unpack_stored(spec[1])
            except codec.CodecError as exc:
                raise _bad(where, f"field {name!r}: malformed value: {exc}") from None
        else:
            raise _bad(where, f"field {name!r} has unknown kind {kind!r}")
    return row, ranges


def _check_ident(header: dict, expect, where) -> None:
    """The row a version 2 record names against ``expect`` (``(partition_id or None,
    key, generation or None)``: None parts are not checked)."""
    pid, key, gen = expect
    got = (header.get("p"), header.get("k"), header.get("g"))
    if type(got[0]) is not str or type(got[1]) is not str or type(got[2]) is not int:
        raise _bad(where, f"malformed record header: partition {got[0]!r}, key {got[1]!r}, "
                          f"generation {got[2]!r}")
    if got[1] != key or (pid is not None and got[0] != pid) or \
            (gen is not None and got[2] != gen):
        raise _bad(where, f"record holds the row of key {got[1]!r} (partition {got[0]!r}, "
                          f"generation {got[2]}), but the index names key {key!r}"
                          + (f" (partition {pid!r})" if pid is not None else "")
                          + (f" (generation {gen})" if gen is not None else "")
                          + ": the shard holds another key's row")


def decode_record(buf, *, expected_gidx: int | None = None, where: str = "record",
                  expect=None) -> tuple[int, dict]:
    """Decode a record; tensor data are memoryview slices of ``buf`` (no copy), or bytes
    of their own for payloads of at most 184 bytes (smaller than a view).

    Validates magic, header length and structure, that tensor payloads exactly tile the
    payload, and the global index if ``expected_gidx`` is given. With ``expect``
    (``(partition_id or None, key, generation or None)``) the record must be of format
    version 2 and name that row. Does not check the crc. Raises DumpFormatError naming
    ``where``.
    """
    view = memoryview(buf)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    total = view.nbytes
    if total < PREFIX_SIZE:
        raise _bad(where, f"record of {total} bytes is shorter than its prefix")
    magic, hlen = _PREFIX.unpack_from(view, 0)
    if magic != RECORD_MAGIC and (magic != RECORD_MAGIC_V1 or expect is not None):
        raise _bad(where, f"bad record magic {magic!r} (expected {RECORD_MAGIC!r})")
    start = PREFIX_SIZE + hlen
    if start > total:
        raise _bad(where, f"header length {hlen} exceeds the record ({total} bytes)")
    try:
        header = codec.unpack_stored(view[PREFIX_SIZE:start])
    except codec.CodecError as exc:
        raise _bad(where, f"malformed record header: {exc}") from None
    if magic == RECORD_MAGIC:
        if type(header) is not dict or len(header) != 5 or \
                not {"i", "g", "p", "k", "f"} <= header.keys():
            raise _bad(where, "malformed record header (expected keys 'i', 'g', 'p', 'k', 'f')")
        if expect is not None:
            _check_ident(header, expect, where)
    elif type(header) is not dict or len(header) != 2 or "i" not in header or "f" not in header:
        raise _bad(where, "malformed record header (expected keys 'i' and 'f')")
    gidx, specs = header["i"], header["f"]
    if type(gidx) is not int:
        raise _bad(where, f"record global index is not an int: {gidx!r}")
    if expected_gidx is not None and gidx != expected_gidx:
        raise _bad(where, f"record holds global index {gidx}, expected {expected_gidx}")
    if type(specs) is not dict:
        raise _bad(where, "malformed record header (field table is not a map)")
    row, ranges = _header_fields(specs, where)
    payload = total - start
    pos = 0
    if ranges:
        # by offset (ties: by length, then name; names are unique), as tuples compare
        ranges.sort()
        for off, n, name, dtype, shape in ranges:
            if off != pos:
                raise _bad(where, f"field {name!r} payload at {off} overlaps or leaves a gap "
                                  f"(expected {pos})")
            pos += n
            data = view[start + off:start + pos]
            if n <= _COPY_BELOW:
                data = data.tobytes()
            row[name] = _tensor_of(DTYPE_NAMES[dtype], shared_shape(tuple(shape)), data)
    if pos != payload:
        raise _bad(where, f"record length mismatch: header describes {pos} payload bytes, "
                          f"record has {payload}")
    return gidx, row
