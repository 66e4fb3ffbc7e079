"""A unit's dumps: DUMP_ROWS, DUMP_SNAPSHOT, DUMP_WAIT and DUMP_CANCEL.

A dump snapshots the selected rows by reference on the request loop (rows are never changed
in place) and writes the shard in an I/O thread (:class:`~tqtx.storage.dump_job.DumpJob`),
so puts and gets keep flowing while it is written.
"""
from __future__ import annotations

import logging
from array import array
from itertools import repeat

from .. import states as st
from ..wire.columns import unpack_int64
from .dump_job import DumpJob

log = logging.getLogger("tqtx.unit")


class UnitDumps:
    """The dump handlers of :class:`~tqtx.storage.unit.StorageUnit` ``unit``; ``jobs``:
    the dumps snapshotted and not yet answered, by dump ID."""

    def __init__(self, unit):
        self.unit = unit
        self.jobs: dict[str, DumpJob] = {}

    def _start_dump(self, body) -> DumpJob:
        """Snapshot the selected rows by reference now; write the shard in a worker thread.

        C-level passes only: a stored row's dict is never changed in place (puts copy on
        write), so the writer picks the dumped fields out of the very dicts taken here.
        Every row must hold the generation ``gens`` names (else StaleRowsError, nothing
        taken); its record names it, with ``partition_id`` and its key (``keys``).
        """
        unit = self.unit
        indexes, fields_of = unpack_int64(body["indexes"]), unpack_int64(body["fields_of"])
        want, keys = unpack_int64(body["gens"]), body["keys"]
        if not len(indexes) == len(fields_of) == len(want) == len(keys):
            raise ValueError(f"dump {body['dump_id']}: {len(indexes)} indexes but "
                             f"{len(fields_of)} field-set numbers, {len(want)} generations "
                             f"and {len(keys)} keys")
        if fields_of and not 0 <= min(fields_of) <= max(fields_of) < len(body["field_sets"]):
            raise ValueError(f"dump {body['dump_id']}: a field-set number outside the "
                             f"{len(body['field_sets'])} field sets given")
        if array("q", map(unit.gens.get, indexes, repeat(-1))) != array("q", want):
            raise unit.stale(indexes, want, f"dump {body['dump_id']}")
        rows = list(map(unit.rows.__getitem__, indexes))
        # parallel columns, no tuple per row: nothing here for the collector to count
        job = DumpJob(body["dump_id"], (indexes, rows, fields_of, want, keys),
                      body["field_sets"], unit.unit_id, body["partition_id"])
        if body.get("path") is not None:
            job.target(body["path"], bool(body.get("index")))
        self.jobs[job.dump_id] = job
        job.on_done(lambda: self._account_dump(job))
        if job.path is not None:
            self._write(job)
        return job

    def _write(self, job: DumpJob) -> None:
        job.move(st.WRITING)
        self.unit.pool.submit(job.run)

    def _account_dump(self, job: DumpJob) -> None:
        m = self.unit.metrics
        if job.result is not None:
            m.add("dumps_total")
            m.add("dump_rows_total", job.result["rows"])
            m.add("dump_bytes_total", job.result["bytes"])
            m.add("dump_seconds_total", job.result["seconds"])
        else:
            m.add("dump_errors_total")

    def _reply_when_done(self, job: DumpJob, req):
        server = self.unit.server
        deferred = server.deferred(req, server.current_ident)

        def done():
            self.jobs.pop(job.dump_id, None)
            if job.error is not None:
                deferred.reply(error=job.error)
            else:
                deferred.reply(job.result)
        job.on_done(done)
        return deferred

    def dump_rows(self, body, req):
        """Snapshot and write; reply when the shard is written and fsynced."""
        return self._reply_when_done(self._start_dump(body), req)

    def dump_snapshot(self, body, req):
        """Snapshot now and reply at once; without a ``path`` the write waits for DUMP_WAIT."""
        job = self._start_dump(body)
        return {"rows": len(job.snapshot[0])}

    def dump_wait(self, body, req):
        """Reply when the shard is written (starting the write at ``path`` if not begun)."""
        job = self.jobs.get(body["dump_id"])
        if job is None:
            raise RuntimeError(f"unit {self.unit.unit_id} has no dump {body['dump_id']} running")
        if not job.started:
            job.target(body["path"], bool(body.get("index")))
            self._write(job)
        return self._reply_when_done(job, req)

    def dump_cancel(self, body, req):
        job = self.jobs.get(body["dump_id"])
        if job is not None:
            started = job.started
            if not started:
                self.jobs.pop(job.dump_id, None)
            job.cancel()
            log.info("dump %s: unit %d %s", job.dump_id, self.unit.unit_id,
                     "cancelling its shard write" if started else "cancelled before writing")
        return {"cancelled": job is not None}
