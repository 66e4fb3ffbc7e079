"""A unit's side of a transactional restore, top to bottom (the controller's side is
:mod:`tqtx.controller.restores`; the plan types are :mod:`tqtx.plan`).

1. LOAD_ROWS (:meth:`RestoreWorker.load_rows`): claim permission from the controller
   (RESTORE_UNIT ``claim``; its reply travels while the first batch is read, since reading
   changes nothing), read exactly the records assigned (checksums, the key and generation
   each names, the field schema), stage them invisibly, report ``staged`` (or ``failed``).
2. APPLY_STAGED (:meth:`RestoreWorker.apply_staged`): after the controller's journaled
   commit decision, make the staged rows live (idempotent by restore ID; a unit that
   restarted after staging answers ``lost``).
3. DROP_STAGED: an abandoned restore's staged rows go (and a load still reading stops).
4. REDO_RESTORE (:meth:`RestoreWorker.redo_restore`): roll forward from the dump a
   committed restore whose staged rows this unit lost; then APPLY_STAGED again.

See docs/data_dump.md, "Restore" and "Roll-forward from the dump".
"""
from __future__ import annotations

import logging
import threading
import time
from functools import partial

from .. import faults
from .. import format as fmt
from .. import states as st
from ..errors import DumpFormatError, PeerTimeoutError
from ..plan import LoadItem, RedoItem
from ..process.gcpause import gc_paused
from ..schema import validate_row
from ..wire.id_records import IdRecords
from ..wire.peer import CONNECT_TIMEOUT, Peer
from ..wire.values import row_nbytes

log = logging.getLogger("tqtx.unit")

BATCH = 128  # rows per read batch (docs/data_dump.md: "<=128 rows per batch")


class Report:
    """A RESTORE_UNIT report sent now, its reply awaited by :meth:`wait`.

    A lost reply is asked again with the same request ID (the controller answers from its
    record instead of acting twice). A controller that is gone is not retried: PeerDiedError
    as soon as its connection closes after the report was sent, or no connection is made
    within CONNECT_TIMEOUT, so a unit's LOAD_ROWS reply is not held up by retries that
    cannot succeed.
    """

    def __init__(self, peer: Peer, body: dict, *, attempts: int = 3, timeout: float = 15.0):
        if peer.connect_timeout is None:
            peer.connect_timeout = CONNECT_TIMEOUT
        self.peer, self.body, self.attempts, self.timeout = peer, body, attempts, timeout
        self.done = False
        self.first = peer.start("RESTORE_UNIT", body)
        self.rid = self.first.rid

    def wait(self):
        """The controller's reply; raises what the controller answered (e.g. a refusal)."""
        self.done = True
        peer, body = self.peer, self.body
        for attempt in range(self.attempts):
            try:
                if attempt == 0:
                    return self.first.wait(self.timeout)
                return peer.call("RESTORE_UNIT", body, rid=self.rid, timeout=self.timeout)
            except PeerTimeoutError:
                if attempt == self.attempts - 1:
                    raise
                log.warning("restore %s: unit %s: no reply to RESTORE_UNIT %s; retrying",
                            body["restore_id"], body["unit_id"], body["action"])


class ReadPlan:
    """Load items (:class:`tqtx.plan.LoadItem`) grouped for reading: per shard path the
    distinct records to read (``[src, offset, length, crc]``) and the row each must name
    (``expect``: ``{src: (None, key, generation or None)}``, for version 2 dumps); per
    ``(path, src)`` the ``(dest, gen)`` rows it fills."""

    def __init__(self, items, *, check_key: bool):
        self.by_shard: dict[str, list] = {}
        self.shared = False  # some rows read share a region (set by read)
        self.expect: dict[str, dict] = {}
        self.targets: dict[tuple[str, int], list] = {}
        for it in items:
            key = (it.path, it.src)
            t = self.targets.get(key)
            if t is None:
                self.by_shard.setdefault(it.path, []).append([it.src, it.offset, it.length,
                                                              it.crc])
                if check_key:
                    self.expect.setdefault(it.path, {})[it.src] = (None, it.key, it.src_gen)
                self.targets[key] = [(it.dest, it.gen)]
            else:
                t.append((it.dest, it.gen))

    def read(self, schema: dict, staged: dict, after_batch) -> int:
        """Read every record (checksums and, in version 2 dumps, the key and generation it
        names verified), check it against ``schema`` and put it in ``staged`` ({dest: (gen,
        row)}); ``after_batch()`` runs after each batch of at most :data:`BATCH` rows.
        Returns the value bytes read (once per distinct record)."""
        nbytes = 0
        targets = self.targets
        for path, entries in self.by_shard.items():
            self.shared = self.shared or fmt.shares_regions(entries, BATCH)
            for batch in fmt.read_records(path, entries, batch=BATCH,
                                          expect=self.expect.get(path)):
                for src, row in batch:
                    validate_row(row, schema, where=partial(_location, path, src))
                    for dest, gen in targets[(path, src)]:
                        staged[dest] = (gen, row)
                    nbytes += row_nbytes(row)
                after_batch()
        return nbytes


def _location(path, src) -> str:
    return f"{path} record of global index {src}"


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


class RestoreWorker:
    """The restore handlers of :class:`~tqtx.storage.unit.StorageUnit` ``unit``.

    ``staging``: restore ID -> its staged rows ``{dest: (generation, row)}``, invisible
    until applied; ``sharing``: the staged restores whose rows share read regions (see
    :class:`~tqtx.storage.rows.SharedViews`); ``dropped``: restores abandoned here (a load
    still reading stops); ``redoing``: the deferred replies of a roll-forward still
    reading, by restore ID. ``lock`` guards those against the I/O threads."""

    def __init__(self, unit):
        self.unit = unit
        self.staging: dict[str, dict[int, tuple[int, dict]]] = {}
        self.sharing: set[str] = set()
        self.applied = AppliedRestores()
        self.dropped: set[str] = set()
        self.redoing: dict[str, list] = {}
        self.lock = threading.Lock()

    def staged_ids(self) -> list[str]:
        with self.lock:
            return list(self.staging)

    def drop_all(self) -> None:
        """A checkpoint load replaced every row: no staged restore applies any more."""
        with self.lock:
            self.staging.clear()
            self.sharing.clear()

    # ---------------------------------------------------------------- 1. load and stage
    def load_rows(self, body, req):
        """Claim permission, read only the assigned byte ranges, verify, stage invisibly."""
        server = self.unit.server
        deferred = server.deferred(req, server.current_ident)
        self.unit.pool.submit(self._load_job, body["restore_id"], body, deferred)
        return deferred

    @gc_paused  # a row per record, no cycles: a collection would walk every held row
    def _load_job(self, rid, body, deferred):
        unit = self.unit
        uid = unit.unit_id
        t0 = time.perf_counter()
        peer = unit.controller()
        staged: dict[int, tuple[int, dict]] = {}
        claim = None
        try:
            # From here on the controller may have journaled our claim. Reading changes
            # nothing: the claim travels while the first batch is read, and its reply is
            # awaited before anything is staged and before the first read-batch point.
            claim = Report(peer, {"restore_id": rid, "unit_id": uid, "action": st.CLAIM})

            def claimed():
                nonlocal claim
                if claim is not None:
                    pending, claim = claim, None
                    pending.wait()
                    log.info("restore %s: unit %d claimed %d rows", rid, uid, len(body["items"]))
                    faults.hit("unit.load.after_claim")

            def after_batch():
                claimed()
                faults.hit("unit.load.after_read_batch")
                if rid in self.dropped:
                    raise RuntimeError(f"restore {rid} was abandoned while unit {uid} was "
                                       f"loading")

            reads = ReadPlan(map(LoadItem.from_wire, body["items"]),
                             check_key=body.get("format_version", 1) >= 2)
            nbytes = reads.read(body["field_schema"], staged, after_batch)
            claimed()
            with self.lock:
                if rid in self.dropped:
                    raise RuntimeError(f"restore {rid} was abandoned while unit {uid} was "
                                       f"loading")
                self.staging[rid] = staged
                if reads.shared:
                    self.sharing.add(rid)
            faults.hit("unit.load.after_stage")
            try:
                Report(peer, {"restore_id": rid, "unit_id": uid, "action": st.STAGED,
                              "rows": len(staged), "bytes": nbytes}).wait()
            except BaseException:
                with self.lock:
                    self.staging.pop(rid, None)
                    self.sharing.discard(rid)
                raise
            seconds = time.perf_counter() - t0
            log.info("restore %s: unit %d staged %d rows (%d bytes) in %.3fs", rid, uid,
                     len(staged), nbytes, seconds)
            m = unit.metrics
            m.add("loads_total")
            m.add("load_rows_total", len(staged))
            m.add("load_bytes_total", nbytes)
            m.add("load_seconds_total", seconds)
            deferred.reply({"rows": len(staged), "bytes": nbytes, "seconds": seconds})
        except faults.DropReply as exc:
            deferred.reply(error=exc)
        except BaseException as exc:
            log.error("restore %s: unit %d failed: %s", rid, uid, exc)
            staged.clear()
            self._report_failure(peer, rid, claim, exc)
            deferred.reply(error=exc)
        finally:
            peer.close()

    def _report_failure(self, peer: Peer, rid: str, claim: Report | None, exc) -> None:
        uid = self.unit.unit_id
        try:
            if claim is not None and not claim.done:
                claim.wait()  # a claim still in flight: our failure report follows it
        except Exception:  # noqa: BLE001 - the failure below is what gets reported
            pass
        try:
            Report(peer, {"restore_id": rid, "unit_id": uid, "action": st.FAILED,
                          "error": str(exc)}).wait()
        except Exception as report_exc:
            log.error("restore %s: unit %d could not report its failure: %s", rid, uid,
                      report_exc)

    # ---------------------------------------------------------------- 2. apply
    @gc_paused
    def apply_staged(self, body, req):
        """Make a committed restore's staged rows live (idempotent)."""
        rid = body["restore_id"]
        unit = self.unit
        done = self.applied.get(rid)
        if done is not None:
            return done
        with self.lock:
            staged = self.staging.pop(rid, None)
            shared = rid in self.sharing
            self.sharing.discard(rid)
        if staged is None:
            # Neither staged nor applied here: this unit restarted after staging.
            log.error("restore %s: unit %d has no staged rows to apply", rid, unit.unit_id)
            return {"rows": 0, "lost": True}
        # The restore's rows hold the generations of its plan: an existing key's (merged
        # into its row) or a new key's (replacing what an earlier key left at its index).
        skipped = [dest for dest, (gen, values) in staged.items()
                   if not unit.store_row(dest, gen, values)]
        if skipped:
            # A restore's index holds a newer key. The controller never lets that happen (a
            # partition with an open restore refuses clears and new keys, and the restore's
            # new indexes are reserved), so this is a bug: never write over it.
            log.error("restore %s: unit %d did not apply %d rows: their indexes hold newer "
                      "keys (%s)", rid, unit.unit_id, len(skipped), skipped[:10])
        if shared:
            unit.views.watch(unit.bytes_held)
        if unit.attach.write_watch:
            unit.attach.note_writes(staged)
        self.applied.record(rid, len(staged))
        if unit.rowlog is not None:  # replayed, the unit still knows it applied it
            unit.rowlog.applied_restore(rid, len(staged))
        faults.hit("unit.apply.after_apply")
        log.info("restore %s: unit %d applied %d rows", rid, unit.unit_id, len(staged))
        return {"rows": len(staged)}

    # ---------------------------------------------------------------- 3. drop
    def drop_staged(self, body, req):
        rid = body["restore_id"]
        with self.lock:
            self.dropped.add(rid)
            staged = self.staging.pop(rid, None)
            self.sharing.discard(rid)
        log.info("restore %s: unit %d dropped %s staged rows", rid, self.unit.unit_id,
                 0 if staged is None else len(staged))
        return {"dropped": 0 if staged is None else len(staged)}

    # ---------------------------------------------------------------- 4. roll forward
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
        server = self.unit.server
        with self.lock:
            staged = self.staging.get(rid)
            if staged is not None:
                return {"rows": len(staged), "staged": True}
            deferred = server.deferred(req, server.current_ident)
            waiting = self.redoing.get(rid)
            if waiting is not None:  # a redo of this restore is already reading: join it
                waiting.append(deferred)
                return deferred
            self.redoing[rid] = [deferred]
        self.unit.pool.submit(self._redo_job, rid, body)
        return deferred

    def _redo_job(self, rid, body):
        uid = self.unit.unit_id
        t0 = time.perf_counter()
        result, error = None, None
        try:
            result = self._redo_read(rid, body)
            log.info("restore %s: unit %d re-staged %d rows (%d bytes) from %s in %.3fs", rid,
                     uid, result["rows"], result["bytes"], body["dump_dir"],
                     time.perf_counter() - t0)
        except faults.DropReply as exc:
            error = exc
        except BaseException as exc:  # every cause is named in the reply
            log.error("restore %s: unit %d cannot roll forward from %s: %s", rid, uid,
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
            if redo.src not in locations:
                raise DumpFormatError(f"{dump_dir}: has no record of global index {redo.src}")
            path, offset, length, crc = locations[redo.src]
            items.append(LoadItem(redo.dest, redo.gen, path, offset, length, crc,
                                  redo.src, key_of[redo.src], index.gens.get(redo.src)))
        staged: dict[int, tuple[int, dict]] = {}
        reads = ReadPlan(items, check_key=index.version >= 2)
        nbytes = reads.read(body["field_schema"], staged, _nothing)
        faults.hit("unit.redo.after_read")
        with self.lock:
            if rid not in self.applied:
                self.staging[rid] = staged
                if reads.shared:
                    self.sharing.add(rid)
        return {"rows": len(staged), "bytes": nbytes, "redone": True}


def _nothing() -> None:
    pass
