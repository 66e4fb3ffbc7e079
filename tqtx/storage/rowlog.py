"""A unit's rows on disk (durability ``buffer`` and ``sync``): an append-only log, replayed
when the unit starts again on the same data directory.

The files and entries are :mod:`tqtx.format.rowlog`'s: segments of entries (a row stored, rows
dropped, every row replaced, a restore or checkpoint load applied) in the order the unit
applied them; a base (every live row when a segment was opened, written by earlier releases'
compaction) is still read first. Replay reads the newest base, then the segments from its
number on. A torn entry at the end of a file (a crash in the middle of a write) ends that
file; so does a bad entry elsewhere, which is logged: the controller then names the rows it
misses lost when the unit registers. The (index, generation) pair names the key
incarnation: the controller reconciles by it and drops rows no committed put accounts for.

The request loop only queues what a request changed (rows are never changed in place once
stored, so they are encoded later); one writer thread encodes, appends and fsyncs, in queue
order. With ``buffer`` it writes every half ``flush_interval_s`` and fsyncs every
interval. With ``sync`` the reply of a request that stored rows, or read while changes
were not yet durable, is sent after the fsync that covers them: the loop itself writes and
fsyncs at the end of its turn what the turn queued, and answers them (one fsync shared, no
thread switch); the writer does it while busy or while the log is failing. Whoever writes
holds the log's I/O lock, so the queue's order holds.

Compaction frees the oldest file, one at a time, while the files hold more than 1.2x the
live bytes (and ``COMPACT_SLACK`` more). The writer knows in which file each live row
began (a row's first entry of its generation); the loop queues the live rows that began in
the oldest file again, whole, with the marks in it the unit still remembers, as a batch
like any other (a row dropped or replaced before it is not in it); once that batch is
fsynced the oldest file holds nothing live and is deleted, its drops and resets with it
(they concern older files only). So the disk holds at most one file's live rows twice, and
puts and gets go on meanwhile. A checkpoint queues a cut: the writer seals the open segment
and fsyncs, and the files before it are hard-linked into the checkpoint
(:meth:`RowLog.link`). A write that fails (a full disk) is cut off its file and retried
every interval; meanwhile new rows are refused.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from .. import faults
from ..layout import fsutil
from ..format import rowlog as fl
from ..format.records import RecordEncoder
from .logdir import LogDir
from .rowlog_files import LogFiles, file_key, file_name
from .rowlog_queue import Compacted, Cut, Waiter, answer

log = logging.getLogger("tqtx.unit")

# a segment is sealed past this size; the files may exceed COMPACT_RATIO x the live bytes by
# the slack, and by one file's live rows while that file is compacted (at 128 MiB live: 1.45x)
SEGMENT_BYTES = int(os.environ.get("TQTX_ROWLOG_SEGMENT_BYTES", str(16 << 20)))
COMPACT_RATIO = 1.2
COMPACT_SLACK = int(os.environ.get("TQTX_ROWLOG_COMPACT_SLACK", str(16 << 20)))
WAKE_AT = 64  # requests' batches queued that wake the writer before its half interval
_WHOLE = 0    # a queued ROW entry that holds the whole row (a compaction re-logs it)


class RowLog:
    """The row log of one unit in ``directory``.

    ``sync``: replies wait for the fsync of what their request wrote; ``interval``: seconds
    between fsyncs otherwise; ``live_bytes()``: the bytes of the unit's live rows;
    ``rows()``: the unit's rows and their generations, ``(rows, gens)``, as they are now (a
    checkpoint switch replaces both dicts; read on the loop only, by a compaction);
    ``remembers(what, id)``: whether the unit still remembers an applied restore or
    checkpoint load (a compaction logs its mark again only then; loop only)."""

    def __init__(self, directory: str, *, sync: bool, interval: float,
                 live_bytes: Callable[[], int], rows: Callable[[], tuple[dict, dict]],
                 remembers: Callable[[str, str], bool] = lambda what, ident: True,
                 segment_bytes: int | None = None):
        self.dir, self.sync, self.interval = os.fspath(directory), sync, interval
        self.live_bytes, self._rows_now, self._remembers = live_bytes, rows, remembers
        self.segment_bytes = SEGMENT_BYTES if segment_bytes is None else segment_bytes
        self.files = LogDir(self.dir)
        self._files_lock = threading.Lock()
        self._encoder = RecordEncoder()  # the writer's
        self._batch: list = []        # this request's changes (loop only)
        self._queue: list = []        # batches, waiters and markers for the writer
        self._cond = threading.Condition()
        self._io = threading.Lock()  # held by whoever writes: the writer or the loop (sync)
        self._loop_syncs = False  # sync: the loop's turn hook writes (see sync_on_loop)
        self._wake = False  # the writer has something to do before its next turn
        self._stopped, self._thread = False, None
        self._call_soon: Callable = lambda fn: fn()
        # the writer's: the open segment, its number and size, sealed segments' fds not
        # yet fsynced, the log's bytes on disk
        self._fd, self._number, self._size, self._sealed, self._disk = -1, 0, 0, [], 0
        self._files = LogFiles()  # the writer's view of the files, for compaction
        self._failed_at = -COMPACT_SLACK  # the size of the files at the last failed compaction
        self._unsynced = self._dir_dirty = self._compacting = False
        # batches queued that no fsync covers (under _cond); of them, written (under _io)
        self._undurable = self._written = 0
        self.fsyncs = self.compactions = 0
        self.error: BaseException | None = None  # the last failed write or fsync

    # ---------------------------------------------------------------- replay
    def replay(self, store: Callable[[int, int, dict], object],
               drop: Callable[[int, int], object], reset: Callable[[], object],
               mark: Callable[[str, str, int], object]) -> dict:
        """Apply the log to the unit (see :meth:`LogDir.replay`), noting where each live row
        began and each mark is, then open a new segment for what follows."""
        files, current = self._files, [(0, 0)]

        def on_file(kind: str, number: int, size: int) -> None:
            current[0] = file_key(kind, number)
            files.sizes[current[0]] = size

        def store_noted(idx: int, gen: int, values: dict):
            stored = store(idx, gen, values)
            if stored is not None:
                files.row(idx, gen, current[0], False)
            return stored

        def drop_noted(idx: int, gen: int):
            files.drop(idx, gen)
            return drop(idx, gen)

        def reset_noted():
            files.reset()
            return reset()

        def mark_noted(what: str, ident: str, rows: int):
            files.mark(what, ident, rows, current[0])
            return mark(what, ident, rows)

        stats, self._number, self._disk = self.files.replay(
            store_noted, drop_noted, reset_noted, mark=mark_noted, on_file=on_file)
        self._open_segment()
        return stats

    # ---------------------------------------------------------------- queueing (loop)
    def row(self, idx: int, gen: int, values: dict) -> None:
        """Log ``values`` stored at ``idx`` as generation ``gen`` (queued by :meth:`write`)."""
        self._batch.append((fl.ROW, idx, gen, values))

    def drop(self, indexes: list[int], gens: list[int]) -> None:
        """Log that the rows at ``indexes`` of generations ``gens`` were dropped."""
        self._batch.append((fl.DROP, list(indexes), list(gens)))

    def reset(self) -> None:
        """Log that every row went (a checkpoint replaced them; its rows follow)."""
        self._batch.append((fl.RESET,))

    def applied_restore(self, rid: str, rows: int) -> None:
        """Log that restore ``rid`` was applied (its ``rows`` rows were logged before)."""
        self._batch.append((fl.MARK, fl.MARK_RESTORE, rid, rows))

    def applied_checkpoint(self, load_id: str, rows: int) -> None:
        """Log that the unit switched to checkpoint load ``load_id`` (its reset and rows
        were logged before)."""
        self._batch.append((fl.MARK, fl.MARK_CHECKPOINT, load_id, rows))

    def stats(self) -> dict:
        """What STATS reports of the log: its directory and mode, its files' bytes, the
        batches queued for the writer, fsyncs and compactions done, the last write error."""
        return {"dir": self.dir, "sync": self.sync, "flush_interval_s": self.interval,
                "disk_bytes": self._disk, "queued": len(self._queue), "fsyncs": self.fsyncs,
                "compactions": self.compactions,
                "error": None if self.error is None else str(self.error)}

    @property
    def dirty(self) -> bool:
        """Changes not yet queued for the writer."""
        return bool(self._batch)

    @property
    def undurable(self) -> bool:
        """Changes made that no fsync covers yet (loop thread)."""
        return bool(self._batch) or self._undurable > 0

    def write(self) -> None:
        """Hand the changes of this request to the writer thread, in order (loop thread).
        Rows are never changed in place once stored, so the writer encodes them later."""
        batch, self._batch = self._batch, []
        if batch:
            with self._cond:
                self._queue.append(batch)
                self._undurable += 1
                if (self.sync and not self._loop_syncs) or len(self._queue) >= WAKE_AT:
                    self._wake = True
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
        self._enqueue((deferred, reply))

    def reply_when_durable(self, deferred, reply) -> None:
        """Loop thread, a request's deferred reply: :meth:`when_durable`, left for the end
        of the loop's turn when the loop writes (:meth:`sync_on_loop`)."""
        self._enqueue((deferred, reply), wake=not self._loop_syncs)

    def sync_on_loop(self) -> None:
        """The loop's turn hook with ``sync``: write and fsync what this turn's requests
        queued, then answer them from the loop. Left to the writer (woken) while it holds
        the I/O lock, or while the log is failing (it retries every interval)."""
        if not self._queue or self.error is not None:
            return
        if not self._io.acquire(blocking=False):  # the writer is busy: it takes them next
            self._wake_writer()
            return
        try:
            with self._cond:
                items, self._queue, self._wake = self._queue, [], False
            self._sync_and_reply(self._write_items(items, on_loop=True), on_loop=True)
        finally:
            self._io.release()

    def flush(self, timeout: float = 60.0) -> None:
        """Block until every change made so far is written and fsynced."""
        self.write()
        waiter = Waiter()
        self.when_durable(waiter, None)
        waiter.wait(timeout, "a flush")

    def cut(self) -> Cut:
        """Loop thread: mark where the queue stands for a checkpoint (see :class:`Cut`
        and :meth:`link`)."""
        self.write()
        cut = Cut()
        self._enqueue(cut)
        return cut

    def _enqueue(self, item, wake: bool = True) -> None:
        """Queue a waiter or a marker for the writer, and (``wake``) wake it."""
        with self._cond:
            self._queue.append(item)
        if wake:
            self._wake_writer()

    def _wake_writer(self) -> None:
        with self._cond:
            self._wake = True
            self._cond.notify()

    def link(self, cut: Cut, target: str) -> list[dict]:
        """Hard-link (copy across file systems) into ``target`` the files that hold every
        change before ``cut``: the newest base below its segment and the segments from that
        base on (all sealed: nothing is appended to them again, and a later compaction's
        deletions leave the links). ``[{"file", "size"}]`` in replay order."""
        end = cut.wait()
        os.makedirs(target, exist_ok=True)
        out = []
        with self._files_lock:  # a compaction does not delete files meanwhile
            for kind, n in fl.replay_order(self.files.list(), below=end):
                src = self.files.path(kind, n)
                name = fl.file_name(kind, n)
                fsutil.link_or_copy(src, os.path.join(target, name))
                out.append({"file": name, "size": os.path.getsize(src)})
        return out

    def _relog(self, key: tuple, wanted: dict, marks: list) -> None:
        """Loop thread: queue the rows of ``wanted`` (index -> generation) that are still
        live, whole, and the ``marks`` the unit still remembers, then the marker that file
        ``key`` holds nothing live any more."""
        rows, gens = self._rows_now()
        try:
            batch = [(_WHOLE, idx, gen, rows[idx]) for idx, gen in wanted.items()
                     if gens.get(idx) == gen]
            batch += [(fl.MARK, *m) for m in marks if self._remembers(m[0], m[1])]
            faults.hit("unit.rowlog.compact.before_relog")
        except Exception as exc:  # noqa: BLE001 - the file stays; the writer is told
            log.error("row log %s: compaction failed: %r", self.dir, exc)
            batch, marker = [], Compacted(key, failed=True)
        else:
            marker = Compacted(key)
        with self._cond:
            if batch:
                self._queue.append(batch)
            self._queue.append(marker)
            self._wake = True
            self._cond.notify()

    # ---------------------------------------------------------------- the writer thread
    def start(self, call_soon: Callable[[Callable[[], None]], None],
              turn_hooks: list | None = None) -> "RowLog":
        """Start the writer; ``call_soon(fn)`` runs ``fn`` on the request loop; with ``sync``
        and the loop's ``turn_hooks``, the loop writes at the end of each turn."""
        self._call_soon = call_soon
        if self.sync and turn_hooks is not None:
            turn_hooks.append(self.sync_on_loop)
            self._loop_syncs = True
        self._thread = threading.Thread(target=self._writer, name="tqtx-rowlog",
                                        daemon=True)
        self._thread.start()
        return self

    def _writer(self) -> None:
        # With buffer the writer is not woken per request (a thread switch on every put):
        # it writes every half interval, or when WAKE_AT batches wait, a marker or a waiter
        # comes; so what a put queued is written within the interval. With sync every
        # request that stored rows waits, and wakes it.
        step = self.interval if self.sync else self.interval / 2
        last_sync = time.monotonic()
        while True:
            with self._cond:
                if not self._stopped and not self._wake:
                    self._cond.wait(step)
            with self._io:
                with self._cond:
                    items, self._queue, self._wake = self._queue, [], False
                    stopping = self._stopped
                waiters = self._write_items(items)
                due = time.monotonic() >= last_sync + self.interval
                # a compacted file goes after the fsync of the rows logged again: at once
                if waiters or due or stopping or self._files.dead:
                    self._sync_and_reply(waiters)
                    last_sync = time.monotonic()
            if stopping:  # what a failing disk still holds back is lost with the process
                return

    def _write_items(self, items: list, on_loop: bool = False) -> list:
        """Write the queued batches (acting on the markers); returns the waiters met.
        A failed write is cut off its file and the items from it on are queued again to
        be retried after the interval (by the writer: the loop does not wait); its waiters
        get the error."""
        waiters = []
        for pos, item in enumerate(items):
            if type(item) is tuple:
                waiters.append(item)
                continue
            if type(item) is Cut:
                try:
                    self._seal()
                    item.next_segment = self._number
                    waiters.append((item, None))
                except Exception as exc:  # noqa: BLE001 - the checkpoint's error
                    item.reply(error=exc)
                continue
            if type(item) is Compacted:
                self._compacted(item)
                continue
            try:
                self._append(item)
                self._written += 1
                self.error = None
            except Exception as exc:  # noqa: BLE001 - kept, reported, retried
                self.error = exc
                log.error("row log %s: write failed: %r; retried every %gs", self.dir, exc,
                          self.interval)
                rest = items[pos:]
                for other in rest:
                    if type(other) is tuple:
                        answer(other[0], on_loop, error=self._durable_error(exc))
                with self._cond:
                    self._queue[:0] = [i for i in rest if type(i) is not tuple]
                    if not on_loop:
                        self._cond.wait(self.interval)
                break
        return waiters

    def _append(self, batch: list) -> None:
        """Write a batch's entries, sealing the segment where it reaches its size (so no
        file holds much more than ``segment_bytes``, and a compaction logs at most that
        again)."""
        bufs: list = []
        size = 0
        encoder = self._encoder
        logged = []  # the entries in ``bufs``: what they change in the writer's view
        for entry in batch:
            kind = entry[0]
            if kind == fl.ROW or kind == _WHOLE:
                _k, idx, gen, values = entry
                try:
                    more, n = fl.encode_row(idx, gen, values, encoder)
                except (TypeError, ValueError) as exc:
                    # not a transient failure: skip the row rather than block the log (a
                    # recovery names it lost)
                    log.error("row log %s: row %d (generation %d) cannot be logged: %s",
                              self.dir, idx, gen, exc)
                    continue
            elif kind == fl.DROP:
                more, n = fl.encode_drop(entry[1], entry[2])
            elif kind == fl.MARK:
                more, n = fl.encode_mark(entry[1], entry[2], entry[3])
            else:
                more, n = fl.encode_reset()
            logged.append(entry)
            bufs += more
            size += n
            if self._size + size >= self.segment_bytes:
                self._write(bufs, size, logged)
                self._seal()
                bufs, size, logged = [], 0, []
        if logged:
            self._write(bufs, size, logged)
        self._compact_if_due()

    def _write(self, bufs: list, size: int, logged: list) -> None:
        """Append ``bufs`` (the entries ``logged``) to the open segment, all or nothing."""
        faults.hit("unit.rowlog.before_append")
        try:
            fsutil.writev_all(self._fd, bufs)
        except BaseException:
            os.ftruncate(self._fd, self._size)
            raise
        faults.hit("unit.rowlog.after_append")
        here, files = (self._number, 1), self._files
        for entry in logged:
            kind = entry[0]
            if kind == fl.ROW or kind == _WHOLE:
                files.row(entry[1], entry[2], here, kind == _WHOLE)
            elif kind == fl.DROP:
                for idx, gen in zip(entry[1], entry[2]):
                    files.drop(idx, gen)
            elif kind == fl.MARK:
                files.mark(entry[1], entry[2], entry[3], here)
            else:
                files.reset()
        self._size += size
        files.sizes[here] = self._size
        with self._cond:
            self._disk += size
        self._unsynced = True

    # ---------------------------------------------------------------- compaction
    def _compact_if_due(self) -> None:
        """While the files hold too much more than the live rows, free the oldest file:
        at once if nothing live began in it, else ask the loop to log its live rows again
        (one file at a time; writer thread)."""
        files = self._files
        while not self._compacting:
            due_above = max(COMPACT_RATIO * self.live_bytes(), self._failed_at) + COMPACT_SLACK
            if files.live_disk(self._disk) <= due_above:
                return
            oldest = files.oldest((self._number, 1))
            if oldest is None:
                return
            if files.kill(oldest):
                self.compactions += 1
                continue
            self._compacting = True
            wanted, marks = files.live_rows_of(oldest), files.live_marks_of(oldest)
            self._call_soon(lambda: self._relog(oldest, wanted, marks))

    def _compacted(self, marker: Compacted) -> None:
        """The live rows of file ``marker.key`` are logged again: it goes after the next
        fsync (not before the files grew further, if that failed)."""
        self._compacting = False
        if not marker.failed:  # its marks the unit no longer remembers were not logged again
            self._files.forget_marks(marker.key)
        if marker.failed or not self._files.kill(marker.key):
            if not marker.failed:  # a row that could not be encoded again
                log.error("row log %s: rows of %s could not be logged again; the file is "
                          "kept", self.dir, file_name(marker.key))
            self._failed_at = self._disk
            return
        self.compactions += 1
        self._compact_if_due()

    def _remove_dead(self) -> None:
        """Delete the files that hold nothing live (after an fsync of everything written
        before they were found so). A failure keeps them for the next fsync."""
        files = self._files
        if not files.dead:
            return
        freed = 0
        try:
            with self._files_lock:  # not while a checkpoint links them
                for key in list(files.dead):
                    faults.hit("unit.rowlog.compact.before_unlink")
                    self.files.remove(os.path.join(self.dir, file_name(key)))
                    freed += files.removed(key)
            faults.hit("unit.rowlog.compact.after_unlink")
        except Exception as exc:  # noqa: BLE001 - the files stay; tried again later
            log.error("row log %s: removing a compacted file failed: %r", self.dir, exc)
        finally:
            with self._cond:
                self._disk -= freed
        self._dir_dirty = self._dir_dirty or freed > 0

    def _open_segment(self) -> None:
        self._number += 1
        path = self.files.path(fl.SEGMENT, self._number)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._size = 0
        self._files.sizes[(self._number, 1)] = 0
        self._dir_dirty = True

    def _seal(self) -> None:
        """Keep the open segment for its fsync and open the next."""
        self._sealed.append(self._fd)
        self._open_segment()
        faults.hit("unit.rowlog.after_seal")

    def _sync_and_reply(self, waiters: list, on_loop: bool = False) -> None:
        """fsync what was written (sealed segments, the open one, the directory), then
        send the waiters' replies (an fsync error is their error). Compacted files are
        deleted by the writer (within an interval when the loop writes)."""
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
            with self._cond:
                self._undurable -= self._written
            self._written = 0
            if not on_loop:  # the loop never waits for a checkpoint linking the files
                self._remove_dead()
            if self._dir_dirty:
                fsutil.fsync_dir(self.dir)
                self._dir_dirty = False
        except Exception as exc:  # noqa: BLE001 - the waiters get it; the writer goes on
            error = self.error = exc
            log.error("row log %s: fsync failed: %r", self.dir, exc)
        for deferred, reply in waiters:
            if error is None:
                answer(deferred, on_loop, reply)
            else:
                answer(deferred, on_loop, error=self._durable_error(error))

    def _durable_error(self, exc: BaseException) -> OSError:
        return OSError(getattr(exc, "errno", None) or 5, f"row log {self.dir}: the rows were "
                       f"stored but could not be made durable: {exc}")

    # ---------------------------------------------------------------- end
    def close(self, *, remove: bool = False) -> None:
        """Write and fsync what is queued, stop the writer; with ``remove`` (a clean close
        that keeps no buffer) drop what is queued instead and delete every file of the log."""
        self.write()
        with self._cond:
            if remove:  # only replies still wait in the queue; their rows go with the log
                self._queue = [i for i in self._queue if type(i) is tuple]
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for fd in [*self._sealed, self._fd]:
            if fd >= 0:
                os.close(fd)
        self._sealed, self._fd = [], -1
        self.files.release(remove=remove)
