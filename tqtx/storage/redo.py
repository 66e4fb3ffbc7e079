"""REDO_RESTORE: a unit re-reads a committed restore's rows from the dump.

Mixed into :class:`tqtx.storage.unit.StorageUnit` (uses its server, pool, lock, staging
and applied records). See docs/data_dump.md, "Roll-forward from the dump".
"""
from __future__ import annotations

import logging
import time

from .. import faults
from .. import format as fmt
from ..errors import DumpFormatError
from ..wire.id_records import IdRecords
from ..plan import LoadItem, RedoItem
from .loading import ReadPlan, read_and_check

log = logging.getLogger("tqtx.unit")


class AppliedRestores:
    """The restores a unit applied (the last ``size``), each with its row count: what a
    repeated APPLY_STAGED or REDO_RESTORE answers. Kept in an :class:`IdRecords`, so a
    record made while the unit held many rows does not outlive them as small objects."""

    def __init__(self, size: int = 1024):
        self._ids = IdRecords(size, 64)

    def get(self, rid: str) -> dict | None:
        rows = self._ids.get(rid)
        return None if rows is None else {"rows": int(rows)}

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids

    def record(self, rid: str, rows: int) -> None:
        self._ids[rid] = b"%d" % rows


class RedoRestore:
    """Unit handlers for rolling a committed restore forward from its dump."""

    def redo_restore(self, body, req):
        """Re-stage a committed restore's rows from the dump (idempotent by restore ID).

        Sent by the controller after the commit decision to a unit that answered
        APPLY_STAGED with ``lost`` (it restarted after staging). Already applied or still
        staged here: nothing to read. Otherwise the unit reads its records from the dump
        itself (locations from the dump index), verifies them like LOAD_ROWS and stages
        them; the controller then sends APPLY_STAGED. A dump that is gone, replaced or
        damaged is answered ``{"failed": why}`` rather than an error, so the controller can
        keep the restore unresolved and name the cause. Body: ``restore_id``, ``dump_dir``,
        ``dump_id``, ``items`` (:class:`tqtx.plan.RedoItem`), ``field_schema``.
        """
        rid = body["restore_id"]
        done = self.applied.get(rid)
        if done is not None:
            return {**done, "applied": True}
        with self.lock:
            staged = self.staging.get(rid)
            if staged is not None:
                return {"rows": len(staged), "staged": True}
            deferred = self.server.deferred(req, self.server.current_ident)
            waiting = self.redoing.get(rid)
            if waiting is not None:  # a redo of this restore is already reading: join it
                waiting.append(deferred)
                return deferred
            self.redoing[rid] = [deferred]
        self.pool.submit(self._redo_job, rid, body)
        return deferred

    def _redo_job(self, rid, body):
        t0 = time.perf_counter()
        result, error = None, None
        try:
            result = self._redo_read(rid, body)
            log.info("restore %s: unit %d re-staged %d rows (%d bytes) from %s in %.3fs", rid,
                     self.unit_id, result["rows"], result["bytes"], body["dump_dir"],
                     time.perf_counter() - t0)
        except faults.DropReply as exc:
            error = exc
        except BaseException as exc:  # every cause is named in the reply
            log.error("restore %s: unit %d cannot roll forward from %s: %s", rid, self.unit_id,
                      body.get("dump_dir"), exc)
            result = {"failed": f"{type(exc).__name__}: {exc}"}
        with self.lock:
            waiting = self.redoing.pop(rid, [])
        for deferred in waiting:
            deferred.reply(result, error=error)

    def _redo_read(self, rid, body) -> dict:
        dump_dir = body["dump_dir"]
        index = fmt.read_dump_index(dump_dir)
        if body.get("dump_id") and index.dump_id != body["dump_id"]:
            raise DumpFormatError(
                f"{dump_dir}: now holds dump {index.dump_id}, not dump {body['dump_id']} that "
                f"restore {rid} read")
        locations = index.record_locations()
        key_of = {gidx: key for key, gidx, _fields, _tag in index.rows}
        items = []  # in LOAD_ROWS's item form, read from this dump's own index
        for redo in map(RedoItem.from_wire, body["items"]):
            src = redo.src
            if src not in locations:
                raise DumpFormatError(f"{dump_dir}: has no record of global index {src}")
            path, offset, length, crc = locations[src]
            items.append(LoadItem(redo.dest, redo.gen, str(path), offset, length, crc, src,
                                  key_of[src], index.gens.get(src)))
        reads = ReadPlan(items, check_key=index.version >= 2)
        staged: dict[int, tuple[int, dict]] = {}
        nbytes = read_and_check(reads, body["field_schema"], staged, _nothing)
        faults.hit("unit.redo.after_read")
        with self.lock:
            if rid not in self.applied:
                self.staging[rid] = staged
        return {"rows": len(staged), "bytes": nbytes, "redone": True}


def _nothing() -> None:
    pass
