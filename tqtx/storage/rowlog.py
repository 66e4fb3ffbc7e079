"""A unit's rows on disk (durability ``buffer`` and ``sync``): an append-only log, replayed
when the unit starts again on the same data directory.

The data directory (:func:`tqtx.durability.unit_dir`) holds::

    lock            flock of the unit process that owns the directory
    seg-<n>.log     entries in the order the unit applied them
    base-<n>.log    every live row at the moment segment <n> was opened (a compaction)
    base-<n>.tmp    a base being written: ignored and removed by the next replay

An entry is ``b"TQLE" kind:u8 index:i64 generation:i64 length:u32 crc:u32`` and ``length``
bytes of body, ``crc`` the CRC-32C of the body:

``ROW``    a record of the dump format (:mod:`tqtx.format.records`): the fields a put or an
           applied restore stored at ``index`` as ``generation`` (merged into a row of that
           generation, replacing an older one: :meth:`StorageUnit.store_row`)
``DROP``   msgpack ``[[index, ...], [generation, ...]]``: those rows were dropped
``RESET``  empty: every row went (a checkpoint's rows follow as ``ROW`` entries)

Replay reads the newest base, then the segments from its number on. A torn entry at the end
of a file (a crash in the middle of a write) ends that file; so does a bad entry elsewhere,
which is logged: the controller then names the rows it misses lost when the unit registers.
The (index, generation) pair names the key incarnation: the controller reconciles by it and
drops rows no committed put accounts for.

Writes happen on the unit's request loop, at the end of every request that changed rows, so
the file order is the order of the changes. A flusher thread fsyncs: every
``flush_interval_s`` (``buffer``), or as soon as a request waits for it (``sync``: the reply of
a request that wrote is sent after the next fsync, which covers every write made before it
began, so concurrent puts share one fsync). When the files hold more than 1.25x the live
bytes (and 16 MiB more), the loop opens a new segment and snapshots the rows (two dict copies:
stored rows are never changed in place); a background thread writes the snapshot as the new
base, fsyncs and renames it, then removes the files it replaces.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import struct
import threading
import time
from typing import Callable

import filelock

from .. import faults, fsutil
from ..format.records import RecordEncoder, checksum, decode_record, encode_record_parts
from ..wire import codec
from ..wire.values import RawTensor

log = logging.getLogger("tqtx.unit")

ROW, DROP, RESET = 1, 2, 3
_ENTRY = struct.Struct("<4sBqqII")
_MAGIC = b"TQLE"
# a segment is sealed past this size; the files may exceed 1.25x the live bytes by the slack
SEGMENT_BYTES = int(os.environ.get("TQTX_ROWLOG_SEGMENT_BYTES", str(64 << 20)))
COMPACT_SLACK = int(os.environ.get("TQTX_ROWLOG_COMPACT_SLACK", str(16 << 20)))
_NAME = re.compile(r"^(seg|base)-(\d{8})\.(log|tmp)$")


class RowLog:
    """The row log of one unit in ``directory``.

    ``sync``: replies wait for the fsync of what their request wrote; ``interval``: seconds
    between fsyncs otherwise; ``live_bytes()``: the bytes of the unit's live rows;
    ``snapshot()``: ``(rows, gens)`` copies for a compaction (called on the loop)."""

    def __init__(self, directory: str, *, sync: bool, interval: float,
                 live_bytes: Callable[[], int], snapshot: Callable[[], tuple[dict, dict]],
                 segment_bytes: int | None = None):
        self.dir, self.sync, self.interval = os.fspath(directory), sync, interval
        self.live_bytes, self.snapshot = live_bytes, snapshot
        self.segment_bytes = SEGMENT_BYTES if segment_bytes is None else segment_bytes
        os.makedirs(self.dir, exist_ok=True)
        self._lock_file = filelock.FileLock(os.path.join(self.dir, "lock"))
        try:
            self._lock_file.acquire(timeout=0)
        except filelock.Timeout:
            raise RuntimeError(f"{self.dir}: another unit process holds this row log") from None
        self._encoder = RecordEncoder()
        self._pending: list = []      # buffers of entries not yet written (loop only)
        self._fd = -1                 # the open segment (loop writes, flusher fsyncs)
        self._number = 0              # its number
        self._size = 0                # its bytes written
        self._sealed: list[int] = []  # fds of sealed segments not yet fsynced
        self._disk = 0                # bytes in every file of the log
        self._written = 0             # entries' bytes written so far; the flusher syncs up to
        self._synced = 0
        self._dir_dirty = False
        self._compacting = False
        self._waiters: list = []      # (Deferred, reply) for the next fsync (sync)
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.fsyncs = 0
        self.compactions = 0
        self.error: BaseException | None = None  # the last failed fsync

    # ---------------------------------------------------------------- replay
    def replay(self, store: Callable[[int, int, dict], object],
               drop: Callable[[int, int], object], reset: Callable[[], object]) -> dict:
        """Apply the log to the unit through ``store(index, gen, values)``,
        ``drop(index, gen)`` and ``reset()``; then open a new segment for what follows.
        Returns ``{"entries", "bytes", "files", "seconds", "torn"}``."""
        t0 = time.perf_counter()
        files = self._files()
        bases = [n for kind, n in files if kind == "base"]
        start = max(bases) if bases else 0
        order = ([("base", start)] if bases else []) + \
            sorted((k, n) for k, n in files if k == "seg" and n >= start)
        stats = {"entries": 0, "bytes": 0, "files": len(order), "torn": []}
        for kind, n in order:
            path = self._path(kind, n)
            entries, good, size = self._replay_file(path, store, drop, reset)
            stats["entries"] += entries
            stats["bytes"] += good
            if good != size:
                stats["torn"].append(path)
                log.warning("row log %s: %d bytes after offset %d are not a whole entry "
                            "(a write the process did not finish); the entries before are "
                            "replayed", path, size - good, good)
        for kind, n in files:
            if (kind, n) not in order:
                self._remove(self._path(kind, n))
        self._number = max([n for _k, n in files] + [0])
        self._disk = sum(os.path.getsize(self._path(k, n)) for k, n in order)
        self._open_segment()
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def _replay_file(self, path: str, store, drop, reset) -> tuple[int, int, int]:
        """``(entries applied, bytes of whole entries, file size)``."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return 0, 0, 0
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    return self._replay_view(view, size, path, store, drop, reset) + (size,)
                finally:
                    view.release()

    @staticmethod
    def _replay_view(view, size, path, store, drop, reset) -> tuple[int, int]:
        pos = entries = 0
        head = _ENTRY.size
        while pos + head <= size:
            magic, kind, idx, gen, length, crc = _ENTRY.unpack_from(view, pos)
            end = pos + head + length
            if magic != _MAGIC or end > size:
                break
            body = view[pos + head:end]
            if checksum(body) != crc:
                break
            if kind == ROW:
                _gidx, row = decode_record(body, expected_gidx=idx, where=f"{path} at {pos}")
                store(idx, gen, {f: _owned(v) for f, v in row.items()})
            elif kind == DROP:
                indexes, gens = codec.unpackb(bytes(body))
                for i, g in zip(indexes, gens):
                    drop(i, g)
            elif kind == RESET:
                reset()
            else:
                break
            body.release()
            entries += 1
            pos = end
        return entries, pos

    # ---------------------------------------------------------------- appending (loop)
    def row(self, idx: int, gen: int, values: dict) -> None:
        """Log ``values`` stored at ``idx`` as generation ``gen`` (written by :meth:`write`)."""
        head, large, length = encode_record_parts(idx, values, self._encoder, gen=gen,
                                                  partition_id="", key="")
        crc = checksum(head)
        for buf in large:
            crc = checksum(buf, crc)
        self._pending += (_ENTRY.pack(_MAGIC, ROW, idx, gen, length, crc), head, *large)

    def drop(self, indexes: list[int], gens: list[int]) -> None:
        """Log that the rows at ``indexes`` of generations ``gens`` were dropped."""
        body = codec.packb([list(indexes), list(gens)])
        self._pending += (_ENTRY.pack(_MAGIC, DROP, 0, 0, len(body), checksum(body)), body)

    def reset(self) -> None:
        """Log that every row went (a checkpoint replaced them; its rows follow)."""
        self._pending.append(_ENTRY.pack(_MAGIC, RESET, 0, 0, 0, checksum(b"")))

    @property
    def dirty(self) -> bool:
        """Entries not yet written."""
        return bool(self._pending)

    def write(self) -> None:
        """Write the pending entries to the open segment (loop thread). A failed write is
        cut off the file (the segment stays a sequence of whole entries) and raised."""
        bufs, self._pending = self._pending, []
        if not bufs:
            return
        n = sum(len(b) if type(b) is bytes else memoryview(b).nbytes for b in bufs)
        faults.hit("unit.rowlog.before_append")
        try:
            fsutil.writev_all(self._fd, bufs)
        except BaseException:
            os.ftruncate(self._fd, self._size)
            raise
        faults.hit("unit.rowlog.after_append")
        self._size += n
        with self._cond:
            self._disk += n
        self._written += n
        if self._size >= self.segment_bytes:
            self._seal()
        if not self._compacting and \
                self._disk > 1.25 * self.live_bytes() + COMPACT_SLACK:
            self._compact()
        if not self.sync:
            return
        with self._cond:
            self._cond.notify()

    def when_durable(self, deferred, reply) -> None:
        """Send ``reply`` through ``deferred`` once what was written so far is fsynced."""
        with self._cond:
            self._waiters.append((deferred, reply))
            self._cond.notify()

    def _open_segment(self) -> None:
        self._number += 1
        path = self._path("seg", self._number)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._size = 0
        self._dir_dirty = True

    def _seal(self) -> None:
        """Close the open segment for appends (the flusher fsyncs and closes it) and open
        the next."""
        with self._cond:
            self._sealed.append(self._fd)
            self._open_segment()
        faults.hit("unit.rowlog.after_seal")

    # ---------------------------------------------------------------- compaction
    def _compact(self) -> None:
        """Seal, snapshot the rows, and write them as the base of the new segment in a
        background thread."""
        self._seal()
        number = self._number
        rows, gens = self.snapshot()
        self._compacting = True
        threading.Thread(target=self._write_base, args=(number, rows, gens),
                         name="tqtx-rowlog-compact", daemon=True).start()

    def _write_base(self, number: int, rows: dict, gens: dict) -> None:
        tmp, final = self._path("base", number, tmp=True), self._path("base", number)
        try:
            encoder = RecordEncoder()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            size = 0
            try:
                bufs: list = []
                for idx, row in rows.items():
                    gen = gens[idx]
                    head, large, length = encode_record_parts(idx, row, encoder, gen=gen,
                                                              partition_id="", key="")
                    crc = checksum(head)
                    for buf in large:
                        crc = checksum(buf, crc)
                    bufs += (_ENTRY.pack(_MAGIC, ROW, idx, gen, length, crc), head, *large)
                    size += _ENTRY.size + length
                    if len(bufs) >= 512:
                        fsutil.writev_all(fd, bufs)
                        bufs = []
                fsutil.writev_all(fd, bufs)
                faults.hit("unit.rowlog.compact.before_fsync")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            fsutil.fsync_dir(self.dir)
            faults.hit("unit.rowlog.compact.after_rename")
            freed = 0
            for kind, n in self._files():
                if n < number:
                    path = self._path(kind, n)
                    freed += os.path.getsize(path)
                    self._remove(path)
            with self._cond:
                self._disk += size - freed
            self.compactions += 1
            log.info("row log %s: compacted to %d rows (%d bytes; %d bytes freed)", self.dir,
                     len(rows), size, freed)
        except BaseException as exc:  # the log stays as it was: replay does not need a base
            log.error("row log %s: compaction failed: %r", self.dir, exc)
            self._remove(tmp)
        finally:
            self._compacting = False

    # ---------------------------------------------------------------- flushing (thread)
    def start(self) -> "RowLog":
        self._thread = threading.Thread(target=self._flusher, name="tqtx-rowlog-flush",
                                        daemon=True)
        self._thread.start()
        return self

    def _flusher(self) -> None:
        while True:
            with self._cond:
                if not self._stopped and not self._waiters:
                    self._cond.wait(self.interval)
                if self._stopped and not self._waiters:
                    return
                waiters, self._waiters = self._waiters, []
            self.flush(waiters)

    def flush(self, waiters=()) -> None:
        """fsync everything written before this call began; then send ``waiters``' replies
        (an fsync error is their error)."""
        error = None
        try:
            self._sync()
        except Exception as exc:  # noqa: BLE001 - the waiters get it; the flusher goes on
            error = self.error = exc
            log.error("row log %s: fsync failed: %r", self.dir, exc)
        for deferred, reply in waiters:
            if error is None:
                deferred.reply(reply)
            else:
                deferred.reply(error=OSError(getattr(error, "errno", None) or 5,
                                             f"row log {self.dir}: the rows were stored but "
                                             f"could not be made durable: {error}"))

    def _sync(self) -> None:
        written = self._written
        with self._cond:
            sealed, self._sealed = self._sealed, []
            fd, dir_dirty = self._fd, self._dir_dirty
            self._dir_dirty = False
        for s in sealed:
            os.fsync(s)
            os.close(s)
        if written != self._synced or sealed:
            faults.hit("unit.rowlog.before_fsync")
            os.fsync(fd)
            self.fsyncs += 1
            self._synced = written
        if dir_dirty:
            fsutil.fsync_dir(self.dir)

    # ---------------------------------------------------------------- end
    def close(self, *, remove: bool = False) -> None:
        """Stop the flusher after a last fsync; with ``remove`` delete every file of the
        log (a clean close that keeps no buffer)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self.write()
            self.flush()
        finally:
            for fd in [*self._sealed, self._fd]:
                if fd >= 0:
                    os.close(fd)
            self._sealed, self._fd = [], -1
            if remove:
                for kind, n in self._files():
                    self._remove(self._path(kind, n))
                    self._remove(self._path(kind, n, tmp=True))
            self._lock_file.release()
            if remove:
                self._remove(os.path.join(self.dir, "lock"))
                try:
                    os.rmdir(self.dir)
                except OSError:
                    pass  # something else is in there: not ours to remove

    # ---------------------------------------------------------------- files
    def _path(self, kind: str, number: int, *, tmp: bool = False) -> str:
        return os.path.join(self.dir, f"{kind}-{number:08d}.{'tmp' if tmp else 'log'}")

    def _files(self) -> list[tuple[str, int]]:
        """``(kind, number)`` of this log's files (``.tmp`` leftovers are removed)."""
        out = []
        for name in os.listdir(self.dir):
            m = _NAME.match(name)
            if m is None:
                continue
            if m.group(3) == "tmp":
                self._remove(os.path.join(self.dir, name))
            else:
                out.append((m.group(1), int(m.group(2))))
        return sorted(out)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _owned(value):
    """A replayed value that owns its bytes (not a view of the mapped log file)."""
    if type(value) is RawTensor and type(value.data) is memoryview:
        return value.compact()
    return value
