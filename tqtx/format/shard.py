"""Shard files: append-only files of concatenated records, written with writev and read
back with pread. ``shards/unit-<k>.bin`` holds unit ``k``'s records."""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

from tqtx import faults
from tqtx.layout import fsutil, pages
from tqtx.layout.paths import (SHARDS_DIR, shard_file_name,  # noqa: F401 (re-exported)
                               shard_index_name)
from tqtx.errors import DumpFormatError

from .records import RecordEncoder, checksum, decode_record, encode_record_parts, file_error


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Records are handed to writev in batches (so a long stream of rows does not keep every
# source buffer alive). With cores to spare, batches of at least _ASYNC_MIN_BYTES are
# written by a helper thread while the next one is encoded and checksummed. Without (a
# host whose units share two cores), that thread only takes turns with the others: each
# batch is written by the caller right after it was checksummed, small enough that its
# bytes are still in the CPU's cache for the copy (None: never a helper). Four units saving
# a 258 MiB checkpoint on 2 cores take about 0.9x the time of 8 MiB batches with a helper.
_SPARE_CORES = _usable_cores() >= 4
_BATCH_BYTES = 8 << 20 if _SPARE_CORES else 1 << 20
_ASYNC_MIN_BYTES = 4 << 20 if _SPARE_CORES else None


def shard_dump_dir(path, unit) -> Path:
    """The dump (or staging) directory holding the shard at ``path``; ValueError unless
    ``path`` is named as :func:`shard_file_name` says for ``unit``."""
    p, rel = Path(path), Path(shard_file_name(unit))
    if p.parts[-len(rel.parts):] != rel.parts:
        raise ValueError(f"{path}: not the shard of unit {unit} (expected .../{rel})")
    return p.parents[len(rel.parts) - 1]


def by_offset(entry):
    """Sort key of a ``[global_index, offset, length, crc32]`` entry: its offset."""
    return entry[1]


class ShardWriter:
    """Append-only writer of one shard file (created exclusively).

    ``entries`` lists ``[global_index, offset, length, crc32]`` per record written and
    ``bytes_written`` the shard size so far. Usable as a context manager: a clean exit
    closes (with fsync), an exception aborts (closes and removes the file).
    """

    def __init__(self, path):
        self.path = Path(path)
        self.fd: int | None = os.open(
            self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | fsutil.O_CLOEXEC, 0o644)
        self.entries: list[list[int]] = []
        self.bytes_written = 0
        self._pool: ThreadPoolExecutor | None = None

    def write_rows(self, rows: Iterable[tuple[int, dict, int, str, str]]) -> None:
        """Append one record per ``(global_index, row, generation, partition_id, key)``,
        batched through os.writev.

        With cores to spare, large batches are written by a helper thread while the next
        batch is encoded and checksummed (both release the GIL), so crc32 and copying
        overlap; the last batch is written by the calling thread (nothing is left to
        overlap with). Otherwise the calling thread writes each batch (_BATCH_BYTES).
        """
        if self.fd is None:
            raise ValueError(f"{self.path}: shard writer is closed")
        iov: list = []
        pending: list[list[int]] = []
        pending_bytes = 0
        offset = self.bytes_written
        inflight: Future | None = None
        crc32 = checksum
        iov_max = fsutil.IOV_MAX
        encoder = RecordEncoder()
        try:
            for gidx, row, gen, pid, key in rows:
                head, large, length = encode_record_parts(gidx, row, encoder, gen=gen,
                                                          partition_id=pid, key=key)
                if iov and (len(iov) + 1 + len(large) > iov_max
                            or pending_bytes >= _BATCH_BYTES):
                    inflight = self._submit(inflight, iov, pending, pending_bytes)
                    iov, pending, pending_bytes = [], [], 0
                crc = crc32(head)
                iov.append(head)
                for buf in large:
                    crc = crc32(buf, crc)
                    iov.append(buf)
                pending.append([gidx, offset, length, crc])
                pending_bytes += length
                offset += length
            if inflight is not None:
                inflight, done = None, inflight
                done.result()
            if iov:
                self._flush(iov, pending, pending_bytes)
        except BaseException:
            if inflight is not None:
                inflight.exception()  # wait: the file must not be written behind our back
            self._close_fd()  # the file now ends at an unknown position
            raise

    def _submit(self, inflight, iov, pending, nbytes):
        if inflight is not None:
            inflight.result()
        if _ASYNC_MIN_BYTES is None or nbytes < _ASYNC_MIN_BYTES:
            self._flush(iov, pending, nbytes)
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tqtx-shard-writer")
        return self._pool.submit(self._flush, iov, pending, nbytes)

    def _flush(self, iov: list, pending: list, nbytes: int) -> None:
        with fsutil.naming(self.path, "writing shard"):
            fsutil.writev_all(self.fd, iov)
        self.entries.extend(pending)
        self.bytes_written += nbytes

    def close(self, fsync: bool = True) -> list:
        """Fsync (optionally) and close the shard; returns ``entries``."""
        if self.fd is None:
            return self.entries
        try:
            faults.hit("unit.dump.after_write")
            if fsync:
                with fsutil.naming(self.path, "fsync of shard"):
                    os.fsync(self.fd)
        finally:
            self._close_fd()
        if fsync:
            fsutil.fsync_dir(self.path.parent)
        return self.entries

    def abort(self) -> None:
        """Close without fsync and remove the partial shard file."""
        self._close_fd()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _close_fd(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


def read_entry(fd: int, entry, verify: bool, label: str, expect=None,
               into: memoryview | None = None) -> tuple[int, dict]:
    """Read and decode the record ``entry`` ([gidx, offset, length, crc32]) of open shard
    ``fd`` (``into``: a fresh view of its length to read it into, else memory of its own),
    checking its crc32 if ``verify`` and the row it names against ``expect`` (see
    :func:`decode_record`); errors name ``label`` and the record."""
    gidx, offset, length, crc = entry
    if into is None:
        data = fsutil.pread_fresh(fd, length, offset)
    else:
        data = into[:fsutil.pread_into(fd, into, offset)]
    if len(data) != length:
        raise DumpFormatError(f"{label}: record for global index {gidx} (offset {offset}, "
                              f"length {length}): truncated shard: read {len(data)} bytes")
    if verify and checksum(data) != crc:
        raise DumpFormatError(f"{label}: record for global index {gidx} (offset {offset}, "
                              f"length {length}): checksum (CRC-32C) mismatch ({checksum(data):#010x}, "
                              f"index says {crc:#010x})")
    try:
        return decode_record(data, expected_gidx=gidx, where=label, expect=expect)
    except DumpFormatError as exc:
        # Build the detailed location only on failure (keeps the hot path cheap).
        msg = str(exc)[len(label) + 2:]
        raise DumpFormatError(f"{label}: record for global index {gidx} (offset {offset}, "
                              f"length {length}): {msg}") from None


def read_records(path, entries, *, batch: int = 128, verify: bool = True,
                 where_prefix: str | None = None,
                 expect: dict | None = None) -> Iterator[list[tuple[int, dict]]]:
    """Read ``entries`` ([gidx, offset, length, crc32]) from a shard, ``batch`` at a time.

    Yields lists of ``(global_index, row)`` with at most ``batch`` rows, each record read
    by offset order within its batch (see :func:`_places` for where); checks crc32 if
    ``verify``, and with ``expect`` (``{global_index: (partition_id or None, key,
    generation or None)}``, every entry's) that each record names that row. Errors raise
    DumpFormatError naming the file and the global index.
    """
    if batch < 1:
        raise ValueError("batch must be >= 1")
    label = f"{where_prefix}: {path}" if where_prefix else str(path)
    try:
        fd = os.open(path, os.O_RDONLY | fsutil.O_CLOEXEC)
    except FileNotFoundError:
        raise file_error(label, "shard file is missing", missing=True) from None
    try:
        for start in range(0, len(entries), batch):
            chunk = sorted(entries[start:start + batch], key=by_offset)
            places = _places(chunk)
            if expect is None:
                yield [read_entry(fd, e, verify, label, None, into)
                       for e, into in zip(chunk, places)]
            else:
                yield [read_entry(fd, e, verify, label, expect[e[0]], into)
                       for e, into in zip(chunk, places)]
    finally:
        os.close(fd)


def _region_sizes(chunk: list) -> list[int]:
    # a record's header is at most a few hundred bytes: its row's values fill over 99% of
    # a record of FRESH_MIN bytes
    return [e[2] if e[2] >= fsutil.FRESH_MIN else 0 for e in chunk]


def shares_regions(entries: list, batch: int) -> bool:
    """Whether :func:`read_records` of ``entries`` in batches of ``batch`` reads some rows
    into a region they share (their owner then watches it, see
    :class:`tqtx.storage.rows.SharedViews`)."""
    return any(sum(_region_sizes(entries[start:start + batch])) >= pages.REGION_MIN
               for start in range(0, len(entries), batch))


def _places(chunk: list) -> list:
    """Where each record of ``chunk`` is read: the records of at least FRESH_MIN bytes,
    when they add up to pages.REGION_MIN, into slices of one fresh region
    (:func:`pages.fresh_region`); the others (None) into memory of their own."""
    sizes = _region_sizes(chunk)
    total = sum(sizes)
    if total < pages.REGION_MIN:
        return [None] * len(chunk)
    region = pages.fresh_region(total)
    places, pos = [], 0
    for n in sizes:
        places.append(region[pos:pos + n] if n else None)
        pos += n
    return places
