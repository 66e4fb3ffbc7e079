"""A unit's dump of one shard: the snapshot of rows it writes, and who waits for it."""
from __future__ import annotations

import logging
import threading
import time

from .. import faults
from .. import format as fmt
from .. import states as st

log = logging.getLogger("tqtx.unit")


class DumpJob:
    """One shard being written from a snapshot of rows (held by reference, never copied):
    ``(indexes, row dicts, field-set numbers, generations, keys)``, the fields named by
    ``field_sets``, every row of partition ``partition_id``."""

    def __init__(self, dump_id: str, snapshot: tuple, field_sets: list, unit_id: int,
                 partition_id: str):
        self.dump_id, self.snapshot, self.unit_id = dump_id, snapshot, unit_id
        self.partition_id = partition_id
        self.path: str | None = None
        self.write_index = False
        self.field_sets = field_sets
        self._callbacks: list | None = []  # None once finished
        self._lock = threading.Lock()
        self.state = st.SNAPSHOTTED  # see tqtx.states.DUMP_JOB
        self.cancelled = threading.Event()  # tells the writer thread to stop
        self.result: dict | None = None
        self.error: BaseException | None = None

    def move(self, to: str) -> None:
        with self._lock:
            st.check(st.DUMP_JOB, self.state, to,
                     subject=f"dump {self.dump_id}: unit {self.unit_id}'s shard")
            self.state = to

    @property
    def started(self) -> bool:
        return self.state != st.SNAPSHOTTED

    def cancel(self) -> None:
        """Stop the job: released at once if it has not started writing, else the writer
        stops at its next batch (the job then ends cancelled)."""
        with self._lock:
            state = self.state
            if state == st.SNAPSHOTTED:
                self.state = st.CANCELLED
            elif state == st.WRITING:
                self.state = st.CANCELLING
                self.cancelled.set()
        if state == st.SNAPSHOTTED:
            self.release()

    def target(self, path: str, write_index: bool) -> None:
        """Where the shard goes; ``write_index``: its index too, beside it (the shard must
        then be named as the format says: ValueError before anything is written)."""
        if write_index:
            fmt.shard_dump_dir(path, self.unit_id)
        self.path, self.write_index = path, write_index

    def on_done(self, fn) -> None:
        """Call ``fn()`` when the job has finished (now, if it has)."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn()

    def _finish(self) -> None:
        # The callbacks are dropped once run: they refer to the job, and a cycle (as through
        # a Future's callback list) would keep its index entries, 14 objects a row, alive
        # until a full collection.
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks:
            try:
                fn()
            except Exception:
                log.exception("dump %s: unit %d: a completion callback failed", self.dump_id,
                              self.unit_id)

    def release(self) -> None:
        """Drop the snapshot: the rows it kept alive are freed with their last reference."""
        self.snapshot = ((), (), (), (), ())

    def _rows(self):
        field_sets = self.field_sets
        wanted = [frozenset(fs) for fs in field_sets]
        pid = self.partition_id
        for i, (idx, row, sid, gen, key) in enumerate(zip(*self.snapshot)):
            if i % 256 == 0 and self.cancelled.is_set():
                raise RuntimeError(f"dump {self.dump_id} cancelled")
            if row.keys() != wanted[sid]:  # else the row itself
                try:
                    row = {f: row[f] for f in field_sets[sid]}
                except KeyError as exc:
                    raise KeyError(f"unit {self.unit_id}: row {idx} has no field {exc} "
                                   f"(dump {self.dump_id})") from None
            yield idx, row, gen, pid, key

    def run(self) -> None:
        t0 = time.perf_counter()
        writer = None
        end = st.DONE
        try:
            faults.hit("unit.dump.before_write")
            writer = fmt.ShardWriter(self.path)
            writer.write_rows(self._rows())
            entries = writer.close(fsync=True)
            if self.write_index:  # beside the shard, in parallel with the other units
                result = {"index": fmt.write_shard_index(
                    fmt.shard_dump_dir(self.path, self.unit_id), self.unit_id, entries)}
            else:
                result = {"entries": entries}
            faults.hit("unit.dump.after_fsync")
            if self.cancelled.is_set():
                raise RuntimeError(f"dump {self.dump_id} cancelled")
            self.result = {**result, "bytes": writer.bytes_written, "rows": len(entries),
                           "seconds": time.perf_counter() - t0}
            log.info("dump %s: unit %d wrote %d rows (%d bytes) to %s in %.3fs", self.dump_id,
                     self.unit_id, len(entries), writer.bytes_written, self.path,
                     self.result["seconds"])
        except BaseException as exc:
            if writer is not None:
                writer.abort()
            self.error = exc
            end = st.CANCELLED if self.cancelled.is_set() else st.FAILED
            log.error("dump %s: unit %d failed: %s", self.dump_id, self.unit_id, exc)
        finally:
            self.release()
            self.move(end)
            self._finish()
