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

The request loop only queues what a request changed (rows are never changed in place once
stored, so they are encoded later); one writer thread encodes, appends and fsyncs, in queue
order: every ``flush_interval_s`` (``buffer``), or as soon as a request waits for it
(``sync``: the reply of a request that stored rows is sent after the fsync that covers
them; requests queued meanwhile share it). When the files hold more than 1.25x the live
bytes (and 16 MiB more), the loop snapshots the rows (two dict copies) where the queue
stands, the writer opens a new segment there, and a compaction thread writes the snapshot
as that segment's base, fsyncs and renames it, then removes the files it replaces. A write
that fails (a full disk) is cut off its file and retried every interval; meanwhile new rows
are refused.
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


class _Rotate:
    """A queue marker: open a new segment here; ``rows``/``gens`` are its base."""

    __slots__ = ("rows", "gens")

    def __init__(self, rows: dict, gens: dict):
        self.rows, self.gens = rows, gens


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
        self._encoder = RecordEncoder()  # the writer's
        self._batch: list = []        # this request's changes (loop only)
        self._queue: list = []        # batches, waiters and rotations for the writer
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._call_soon: Callable = lambda fn: fn()
        # the writer's: the open segment, its number and size, sealed segments' fds not
        # yet fsynced, the log's bytes on disk
        self._fd, self._number, self._size = -1, 0, 0
        self._sealed: list[int] = []
        self._disk = 0
        self._failed_at = -COMPACT_SLACK  # the size of the files at the last failed compaction
        self._unsynced = self._dir_dirty = self._compacting = False
        self.fsyncs = 0
        self.compactions = 0
        self.error: BaseException | None = None  # the last failed write or fsync

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

    # ---------------------------------------------------------------- queueing (loop)
    def row(self, idx: int, gen: int, values: dict) -> None:
        """Log ``values`` stored at ``idx`` as generation ``gen`` (queued by :meth:`write`)."""
        self._batch.append((ROW, idx, gen, values))

    def drop(self, indexes: list[int], gens: list[int]) -> None:
        """Log that the rows at ``indexes`` of generations ``gens`` were dropped."""
        self._batch.append((DROP, list(indexes), list(gens)))

    def reset(self) -> None:
        """Log that every row went (a checkpoint replaced them; its rows follow)."""
        self._batch.append((RESET,))

    @property
    def dirty(self) -> bool:
        """Changes not yet queued for the writer."""
        return bool(self._batch)

    def write(self) -> None:
        """Hand the changes of this request to the writer thread, in order (loop thread).
        Rows are never changed in place once stored, so the writer encodes them later."""
        batch, self._batch = self._batch, []
        if batch:
            with self._cond:
                self._queue.append(batch)
                self._cond.notify()

    def refuse_if_failing(self) -> None:
        """OSError while the log cannot be written (a full disk): a put is refused before
        it stores anything, rather than acknowledged with rows no file holds."""
        if self.error is not None:
            raise OSError(getattr(self.error, "errno", None) or 5,
                          f"row log {self.dir} cannot be written ({self.error}); rows are "
                          f"refused until it can")

    def when_durable(self, deferred, reply) -> None:
        """Send ``reply`` through ``deferred`` once every change queued so far is fsynced."""
        with self._cond:
            self._queue.append((deferred, reply))
            self._cond.notify()

    def flush(self, timeout: float = 60.0) -> None:
        """Block until every change made so far is written and fsynced."""
        done, errors = threading.Event(), []

        class _Wait:
            def reply(self, result=None, error=None):
                errors.append(error)
                done.set()

        self.write()
        self.when_durable(_Wait(), None)
        if not done.wait(timeout):
            raise TimeoutError(f"row log {self.dir}: not flushed within {timeout}s")
        if errors[0] is not None:
            raise errors[0]

    def _start_compaction(self) -> None:
        """Loop thread: snapshot the rows where the queue stands; the writer opens a new
        segment there and a compaction thread writes the snapshot as its base."""
        rows, gens = self.snapshot()
        with self._cond:
            self._queue.append(_Rotate(rows, gens))
            self._cond.notify()

    # ---------------------------------------------------------------- the writer thread
    def start(self, call_soon: Callable[[Callable[[], None]], None]) -> "RowLog":
        """Start the writer; ``call_soon(fn)`` runs ``fn`` on the request loop."""
        self._call_soon = call_soon
        self._thread = threading.Thread(target=self._writer, name="tqtx-rowlog",
                                        daemon=True)
        self._thread.start()
        return self

    def _writer(self) -> None:
        if not self.sync:
            _lower_priority()
        last_sync = time.monotonic()
        while True:
            with self._cond:
                if not self._queue and not self._stopped:
                    self._cond.wait(max(0.0, last_sync + self.interval - time.monotonic()))
                items, self._queue = self._queue, []
                stopping = self._stopped
            waiters = self._write_items(items)
            due = time.monotonic() >= last_sync + self.interval
            if waiters or due or stopping:
                self._sync_and_reply(waiters)
                last_sync = time.monotonic()
            if stopping and not self._queue:
                return

    def _write_items(self, items: list) -> list:
        """Write the queued batches (rotating at the markers); returns the waiters met.
        A failed write is cut off its file and the items from it on are queued again to
        be retried after the interval; its waiters get the error."""
        waiters = []
        for pos, item in enumerate(items):
            if type(item) is tuple:
                waiters.append(item)
                continue
            try:
                if type(item) is _Rotate:
                    self._rotate(item)
                else:
                    self._append(item)
                self.error = None
            except Exception as exc:  # noqa: BLE001 - kept, reported, retried
                self.error = exc
                log.error("row log %s: write failed: %r; retried every %gs", self.dir, exc,
                          self.interval)
                rest = items[pos:]
                for other in rest:
                    if type(other) is tuple:
                        other[0].reply(error=self._durable_error(exc))
                with self._cond:
                    self._queue[:0] = [i for i in rest if type(i) is not tuple]
                    self._cond.wait(self.interval)
                break
        return waiters

    def _append(self, batch: list) -> None:
        bufs: list = []
        size = 0
        encoder = self._encoder
        for entry in batch:
            kind = entry[0]
            if kind == ROW:
                _k, idx, gen, values = entry
                head, large, length = encode_record_parts(idx, values, encoder, gen=gen,
                                                          partition_id="", key="")
                crc = checksum(head)
                for buf in large:
                    crc = checksum(buf, crc)
                bufs += (_ENTRY.pack(_MAGIC, ROW, idx, gen, length, crc), head, *large)
            elif kind == DROP:
                body = codec.packb([entry[1], entry[2]])
                length = len(body)
                bufs += (_ENTRY.pack(_MAGIC, DROP, 0, 0, length, checksum(body)), body)
            else:
                length = 0
                bufs.append(_ENTRY.pack(_MAGIC, RESET, 0, 0, 0, checksum(b"")))
            size += _ENTRY.size + length
        faults.hit("unit.rowlog.before_append")
        try:
            fsutil.writev_all(self._fd, bufs)
        except BaseException:
            os.ftruncate(self._fd, self._size)
            raise
        faults.hit("unit.rowlog.after_append")
        self._size += size
        with self._cond:
            self._disk += size
        self._unsynced = True
        if self._size >= self.segment_bytes:
            self._seal()
        if not self._compacting:
            self._compact_if_due()

    def _compact_if_due(self) -> bool:
        """Ask the loop for a compaction if the files hold too much more than the live
        rows (writer thread, or the compaction thread as it ends)."""
        if self._disk <= max(1.25 * self.live_bytes() + COMPACT_SLACK,
                             self._failed_at + COMPACT_SLACK):
            return False
        self._compacting = True
        self._call_soon(self._start_compaction)
        return True

    def _open_segment(self) -> None:
        self._number += 1
        path = self._path("seg", self._number)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._size = 0
        self._dir_dirty = True

    def _seal(self) -> None:
        """Keep the open segment for its fsync and open the next."""
        self._sealed.append(self._fd)
        self._open_segment()
        faults.hit("unit.rowlog.after_seal")

    def _sync_and_reply(self, waiters: list) -> None:
        """fsync what was written (sealed segments, the open one, the directory), then
        send the waiters' replies (an fsync error is their error)."""
        error = None
        try:
            for fd in self._sealed:
                os.fsync(fd)
            if self._unsynced or self._sealed:
                faults.hit("unit.rowlog.before_fsync")
                os.fsync(self._fd)
                self.fsyncs += 1
            for fd in self._sealed:
                os.close(fd)
            self._sealed, self._unsynced = [], False
            if self._dir_dirty:
                fsutil.fsync_dir(self.dir)
                self._dir_dirty = False
        except Exception as exc:  # noqa: BLE001 - the waiters get it; the writer goes on
            error = self.error = exc
            log.error("row log %s: fsync failed: %r", self.dir, exc)
        for deferred, reply in waiters:
            if error is None:
                deferred.reply(reply)
            else:
                deferred.reply(error=self._durable_error(error))

    def _durable_error(self, exc: BaseException) -> OSError:
        return OSError(getattr(exc, "errno", None) or 5, f"row log {self.dir}: the rows were "
                       f"stored but could not be made durable: {exc}")

    # ---------------------------------------------------------------- compaction
    def _rotate(self, rotate: "_Rotate") -> None:
        """Open a new segment where the snapshot was taken; write its base in a thread."""
        self._seal()
        threading.Thread(target=self._write_base, args=(self._number, rotate.rows,
                                                        rotate.gens),
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
            self._failed_at = self._disk  # not again before the files grew further
            self._compacting = False
            return
        # what was written meanwhile may already call for the next one
        self._compacting = self._compact_if_due()

    # ---------------------------------------------------------------- end
    def close(self, *, remove: bool = False) -> None:
        """Write and fsync what is queued, stop the writer; with ``remove`` delete every
        file of the log (a clean close that keeps no buffer)."""
        self.write()
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
        else:
            self._sync_and_reply(self._write_items(self._queue))
        for fd in [*self._sealed, self._fd]:
            if fd >= 0:
                os.close(fd)
        self._sealed, self._fd = [], -1
        if remove:
            for kind, n in self._files():
                self._remove(self._path(kind, n))
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


def _lower_priority() -> None:
    """Run this thread at a lower CPU priority (Linux: a nice value per thread). With
    ``buffer`` a write only has to land within the interval, so the requests the unit (and
    the other processes of the host) serve go first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _owned(value):
    """A replayed value that owns its bytes (not a view of the mapped log file)."""
    if type(value) is RawTensor and type(value.data) is memoryview:
        return value.compact()
    return value
