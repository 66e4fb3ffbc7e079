"""The controller's side of a transactional restore, top to bottom.

The protocol (docs/data_dump.md, "Restore"; journal states in :mod:`tqtx.states`):

1. BEGIN_RESTORE (:meth:`RestoreProtocol.begin_restore`): resolve keys, reserve the new
   indexes (invisible until the commit) and journal an ``active`` restore with one
   ``pending`` claim per target unit.
2. RESTORE_UNIT (:meth:`RestoreProtocol.restore_unit`): each unit claims permission
   (``claimed``), loads and stages its rows, then reports ``staged`` (or ``failed``).
3. FINISH_RESTORE (:meth:`RestoreProtocol.finish_restore`): the commit rule
   (:func:`tqtx.states.restore_decision`) says commit, wait or abort. A commit journals the
   decision (``committing``), has every unit apply -- rolling forward from the dump a unit
   that lost its staged rows -- then publishes the metadata (``committed``). An abort
   journals the outcome, drops the staged rows and releases the reservations.
4. After a controller restart (:mod:`tqtx.controller.startup`): a restore a previous
   incarnation left ``active`` is ended as ``aborted``, its dump journal row and publications
   settled first; a ``committing`` one is rebuilt from the plan stored with its decision and
   rolled forward by the next FINISH_RESTORE (``recover_data_load``).

:class:`RestoreProtocol` is mixed into :class:`tqtx.controller.server.Controller` and uses
its journal, metadata, unit peers, incarnations and ``validate_dump_schema``.
"""
from __future__ import annotations

import logging

from .. import faults
from .. import states as st
from ..errors import RestorePendingError
from ..plan import RedoItem, RestoreRow
from ..routing import owner
from ..states import IllegalTransition
from ..wire import codec
from ..wire.peer import call_many
from ..wire.rpc import new_id

log = logging.getLogger("tqtx.controller")



def restore_unit_label(body) -> str:
    """Metrics label of a RESTORE_UNIT request: one per action."""
    action = body.get("action") if isinstance(body, dict) else None
    return f"RESTORE_UNIT:{action if action in st.RESTORE_UNIT_ACTIONS else 'other'}"


class RestorePlan:
    """In-memory side of an unresolved restore (the journal holds its state)."""

    def __init__(self, restore_id, partition_id, dump_dir, rows, field_schema, units, new_indexes,
                 dump_id=None):
        self.restore_id = restore_id
        self.partition_id = partition_id
        self.dump_dir = dump_dir
        self.rows: list[RestoreRow] = rows
        self.field_schema = field_schema
        self.units = units
        self.new_indexes = new_indexes
        self.dump_id = dump_id
        self.apply_rids: dict[int, str] = {}
        self.roll: dict[int, str] = {}          # unit -> its st.ROLL_FORWARD state, last time
        self.redo_failed: dict[int, str] = {}   # unit -> why the dump could not provide
        self.last_error: dict[int, BaseException] = {}
        self._packed: bytes | None = None

    _FIELDS = ("restore_id", "partition_id", "dump_dir", "field_schema", "units",
               "new_indexes", "dump_id")

    def encode(self) -> bytes:
        """The plan as stored with the commit decision (msgpack; encoded once: these
        fields do not change after BEGIN_RESTORE)."""
        if self._packed is None:
            d = {f: getattr(self, f) for f in self._FIELDS}
            d["rows"] = [r.to_wire() for r in self.rows]
            self._packed = codec.packb(d)
        return self._packed

    @classmethod
    def decode(cls, data: bytes) -> "RestorePlan":
        d = codec.unpackb(data)
        return cls(d["restore_id"], d["partition_id"], d["dump_dir"],
                   [RestoreRow.from_wire(r) for r in d["rows"]], d["field_schema"], d["units"],
                   d["new_indexes"], d["dump_id"])

    def redo_items(self, uid: int, num_units: int) -> list | None:
        """The REDO_RESTORE items of the rows unit ``uid`` holds; None if a source is
        unknown."""
        items = []
        for r in self.rows:
            if r.fields and owner(r.index, num_units) == uid:
                if r.src is None:
                    return None
                items.append(RedoItem(r.index, r.gen, r.src).to_wire())
        return items


class RestoreProtocol:
    """Controller request handlers and helpers for restores (BEGIN_RESTORE, RESTORE_UNIT,
    FINISH_RESTORE, LIST_RESTORES, GET_RESTORE) and the roll-forward after a commit."""

    # ---------------------------------------------------------------- open restores
    def _unresolved_in(self, pid: str):
        """The plan of the unresolved restore into partition ``pid``, or None."""
        for plan in self.restores.values():
            if plan.partition_id == pid:
                return plan
        return None

    def _pending_error(self, plan: RestorePlan, what: str) -> RestorePendingError:
        """RestorePendingError refusing ``what`` while ``plan``'s restore is unresolved."""
        rec = self.journal.get_restore(plan.restore_id) or {}
        units = {u["unit_id"]: u["state"] for u in rec.get("units", [])}
        reason = st.pending_reason(units.values())
        if str(rec.get("reason") or "").startswith(st.REDO_FAILED):
            reason = st.REDO_FAILED
        err = RestorePendingError(restore_id=plan.restore_id, dump_dir=plan.dump_dir,
                                  reason=reason, units=units, partition_id=plan.partition_id)
        return RestorePendingError(f"{what} refused: {err.describe()}", restore_id=plan.restore_id,
                                   dump_dir=plan.dump_dir, reason=reason, units=units,
                                   partition_id=plan.partition_id)

    # ---------------------------------------------------------------- requests
    def begin_restore(self, body, req):
        """Resolve keys, reserve new indexes (invisible) and journal one pending claim per unit."""
        rid, pid = body["restore_id"], body["partition_id"]
        existing = self.restores.get(rid)
        if existing is not None:
            return self._plan_reply(existing)
        self._require_units("BEGIN_RESTORE")
        rec = self.journal.get_restore(rid)
        if rec is not None:
            raise RuntimeError(f"restore {rid} already ended: {rec['state']}")
        plan = self._unresolved_in(pid)
        if plan is not None:
            raise self._pending_error(plan, f"a second load into partition {pid!r}")
        self.validate_dump_schema({"partition_id": pid, "field_schema": body["field_schema"]}, req)
        part = self.meta.partition(pid)
        rows_in = body["rows"]
        new_keys = [r[0] for r in rows_in if part is None or r[0] not in part.keys]
        new_idx, new_gens = self.meta.allocate_rows(len(new_keys))
        new_map = dict(zip(new_keys, zip(new_idx, new_gens)))
        rows, units = [], set()
        for row in rows_in:
            key, fields, tag = row[:3]
            # [key, fields, tag, src]: src (the row's global index in the dump) lets a unit
            # that lost its staged rows re-read them after the commit decision
            src = int(row[3]) if len(row) > 3 and row[3] is not None else None
            new = new_map.get(key)
            if new is None:
                idx = part.keys[key]
                plan_row = RestoreRow(key, idx, fields, tag, False, self.meta.gens[idx], src)
            else:
                plan_row = RestoreRow(key, new[0], fields, tag, True, new[1], src)
            rows.append(plan_row)
            if fields:
                units.add(owner(plan_row.index, self.num_units))
        self.meta.reserve(rid, new_idx)
        plan = RestorePlan(rid, pid, body["dump_dir"], rows, body["field_schema"], sorted(units),
                           new_idx, body.get("dump_id"))
        try:
            self.journal.begin_restore(
                restore_id=rid, partition_id=pid, dump_dir=body["dump_dir"],
                dump_id=body.get("dump_id"), incarnation_id=self.incarnation, units=plan.units,
                keys=len(rows), rows=sum(1 for r in rows if r.fields),
                bytes=int(body.get("bytes", 0)))
        except BaseException:
            self._release(plan)
            raise
        self.restores[rid] = plan
        if self.metajournal.enabled:  # encoded while the units load, not in FINISH_RESTORE
            self.server.call_soon(plan.encode)
        log.info("restore %s: begun for partition %r from %s (%d keys, %d new, units %s)",
                 rid, pid, plan.dump_dir, len(rows), len(new_idx), plan.units)
        faults.hit("controller.restore.after_begin")
        return self._plan_reply(plan)

    def _plan_reply(self, plan: RestorePlan) -> dict:
        return {"restore_id": plan.restore_id, "indexes": [r.index for r in plan.rows],
                "new": [r.is_new for r in plan.rows], "gens": [r.gen for r in plan.rows],
                "units": plan.units,
                "num_units": self.num_units, "incarnation": self.incarnation,
                "topology": self.topology_incarnation}

    def _release(self, plan: RestorePlan) -> None:
        self.meta.unreserve(plan.new_indexes, free=True)

    def restore_unit(self, body, req):
        """A unit claims permission, reports its rows staged, or reports failure."""
        rid, uid, action = body["restore_id"], int(body["unit_id"]), body["action"]
        if action in (st.CLAIM, st.STAGED):
            # One journal transaction: the move itself checks that the restore is active
            # (the restore is read again only to word a refusal).
            try:
                if action == st.CLAIM:
                    self.journal.claim_unit(rid, uid)
                else:
                    self.journal.stage_unit(rid, uid, rows=int(body.get("rows", 0)),
                                            bytes=int(body.get("bytes", 0)))
            except (KeyError, IllegalTransition) as exc:
                raise self._refusal(rid, uid, action, exc) from None
            if action == st.CLAIM:
                log.info("restore %s: unit %d claimed", rid, uid)
                faults.hit("controller.restore.after_claim")
            else:
                log.info("restore %s: unit %d staged %s rows", rid, uid, body.get("rows"))
                faults.hit("controller.restore.after_staged")
            return {"ok": True}
        rec = self.journal.get_restore(rid)
        if rec is None:
            raise RuntimeError(f"restore {rid} is unknown to this controller")
        try:
            if action == st.FAILED:
                if rec["state"] == st.ACTIVE:
                    self.journal.fail_unit(rid, uid, str(body.get("error", ""))[:2000])
                log.warning("restore %s: unit %d failed: %s", rid, uid, body.get("error"))
            else:
                raise ValueError(f"unknown RESTORE_UNIT action {action!r}")
        except IllegalTransition as exc:
            raise RuntimeError(str(exc)) from None
        return {"ok": True}

    def _refusal(self, rid: str, uid: int, action: str, exc: BaseException) -> Exception:
        """The error answering a claim or staged report the journal refused."""
        rec = self.journal.get_restore(rid)
        if rec is None:
            return RuntimeError(f"restore {rid} is unknown to this controller")
        if rec["state"] != st.ACTIVE:
            what = "may not load" if action == st.CLAIM else "must drop its staged rows"
            return RuntimeError(f"restore {rid} is {rec['state']}; unit {uid} {what}")
        if isinstance(exc, KeyError):
            return KeyError(exc.args[0] if exc.args else f"restore {rid}: no claim for unit {uid}")
        return RuntimeError(str(exc))

    def finish_restore(self, body, req):
        """Commit (decision journaled first, then units apply, then metadata) or abandon."""
        rid = body["restore_id"]
        plan = self.restores.get(rid)
        rec = self.journal.get_restore(rid)
        if rec is None:
            raise RuntimeError(f"restore {rid} is unknown to this controller")
        if rec["state"] in st.RESTORE_FINAL:
            return self._outcome(rec)
        if rec["state"] == st.COMMITTING:
            # The decision is journaled: whatever was asked, the only way is forward.
            if plan is None:
                raise RuntimeError(f"restore {rid} is committing but this controller has no "
                                   f"plan for it")
            try:
                return self._outcome(self._commit(plan))
            except RestorePendingError as exc:
                if not (body.get("cancel") and exc.reason == st.REDO_FAILED):
                    raise
                self._give_up(plan)
            return self._outcome(self.journal.get_restore(rid))
        commit = bool(body.get("commit"))
        if commit:
            states = {u["unit_id"]: u["state"] for u in rec["units"]}
            decision = st.restore_decision(states.values())
            if decision == st.WAIT:
                raise RestorePendingError(
                    restore_id=rid, dump_dir=rec["dump_dir"], reason=st.UNIT_RUNNING,
                    units=states, partition_id=rec["partition_id"])
            if decision == st.ABORT:
                commit = False
                body = {**body, "reason": body.get("reason") or
                        "not every unit staged its rows: " + ", ".join(
                            f"unit {u}: {s}" for u, s in sorted(states.items()))}
        if commit and plan is not None:
            return self._outcome(self._commit(plan))
        else:
            outcome = st.CANCELLED if body.get("cancel") else st.ABORTED
            self._abort(rid, plan, outcome, body.get("reason") or outcome)
        return self._outcome(self.journal.get_restore(rid))

    def _outcome(self, rec: dict) -> dict:
        return {"restore_id": rec["restore_id"], "outcome": rec["outcome"] or rec["state"],
                "reason": rec["reason"], "state": rec["state"],
                "units": {u["unit_id"]: u["state"] for u in rec["units"]}, "keys": rec["keys"],
                "rows": rec["rows"], "bytes": rec["bytes"]}

    def _encoded(self, plan: RestorePlan) -> bytes | None:
        """The plan to store with the commit decision (when metadata is journaled)."""
        return plan.encode() if self.metajournal.enabled else None

    def _commit(self, plan: RestorePlan) -> dict:
        """Roll a restore forward: decision (journaled; repeating it is a no-op), then every
        unit applies, then metadata; returns the committed restore's record.

        Once decided, a commit only moves forward. An apply that fails or gets no reply is
        retried with the same request ID (so a unit applies once); if a unit still has not
        applied, the restore stays ``committing`` with metadata unpublished, and the next
        FINISH_RESTORE (``recover_data_load``) continues from the journal.
        """
        rid = plan.restore_id
        rec = self.journal.decide_commit(rid, self._encoded(plan))
        log.info("restore %s: commit decided", rid)
        faults.hit("controller.restore.after_commit_decision")
        todo = self._apply_everywhere(plan, rec)
        if plan.redo_failed:
            why = "; ".join(f"unit {u}: {w}" for u, w in sorted(plan.redo_failed.items()))
            reason = f"{st.REDO_FAILED}: {plan.dump_dir}: {why}"
            rec = self.journal.note_reason(rid, reason[:2000])
            units = {u["unit_id"]: u["state"] for u in rec["units"]}
            log.error("restore %s: commit decided but cannot be rolled forward: %s", rid, reason)
            raise RestorePendingError(
                f"restore {rid}: the commit is decided, but unit(s) {sorted(plan.redo_failed)} "
                f"restarted without their staged rows and the dump cannot provide them again "
                f"({reason}). No key of this restore is visible. Put the dump back in place "
                f"and run tqtx.recover_data_load({plan.dump_dir!r}) to roll it forward, or "
                f"tqtx.recover_data_load({plan.dump_dir!r}, cancel=True) to end it as failed.",
                restore_id=rid, dump_dir=plan.dump_dir, reason=st.REDO_FAILED, units=units,
                partition_id=plan.partition_id)
        if todo:
            rec = self.journal.get_restore(rid)
            units = {u["unit_id"]: u["state"] for u in rec["units"]}
            detail = "; ".join(f"unit {u}: {plan.last_error.get(u, 'not registered')}"
                               for u in todo)
            log.error("restore %s: commit decided but units %s have not applied: %s", rid, todo,
                      detail)
            raise RestorePendingError(
                f"restore {rid}: the commit is decided but unit(s) {todo} have not applied "
                f"their staged rows yet ({detail}); the restore stays unresolved and "
                f"tqtx.recover_data_load({plan.dump_dir!r}) rolls it forward",
                restore_id=rid, dump_dir=plan.dump_dir, reason=st.APPLY_PENDING, units=units,
                partition_id=plan.partition_id)
        change, schema = self.meta.plan_publish(plan.partition_id, plan.rows, plan.field_schema)
        # The published metadata and the end of the restore are one journal transaction.
        faults.hit("controller.meta.restore_publish.before_commit")
        done = self.journal.finish_restore(rid, st.COMMITTED, None,
                                           meta_change=change if self.metajournal.enabled else None)
        faults.hit("controller.meta.restore_publish.after_commit")
        self.meta.apply_publish(plan.partition_id, change, schema)
        self.meta.unreserve(plan.new_indexes, free=False)
        self.restores.pop(rid, None)
        faults.hit("controller.restore.after_publish")
        faults.hit("controller.meta.restore_publish.before_reply")
        log.info("restore %s: committed (%d keys)", rid, len(plan.rows))
        return done

    def _abort(self, rid: str, plan: RestorePlan | None, outcome: str, reason: str) -> None:
        rec = self.journal.get_restore(rid)
        self.journal.finish_restore(rid, outcome, reason)
        faults.hit("controller.restore.after_abort_decision")
        units = [u["unit_id"] for u in rec["units"]]
        live = [u for u in units if u in self.unit_peers]
        if live:
            call_many([(self.unit_peers[u], "DROP_STAGED", {"restore_id": rid}) for u in live],
                      raise_first=False, timeout=3)
        if plan is not None:
            self._release(plan)
            self.restores.pop(rid, None)
        log.warning("restore %s: %s (%s)", rid, outcome, reason)

    def list_restores(self, body, req):
        pid = body.get("partition_id")
        out = []
        for rec in self.journal.unresolved_restores():
            if pid is None or rec["partition_id"] == pid:
                out.append(rec)
        return {"restores": out}

    def get_restore(self, body, req):
        return {"restore": self.journal.get_restore(body["restore_id"])}

    # ---------------------------------------------------------------- roll-forward
    # After the commit decision the dump is the restore's redo log: a unit that answers
    # APPLY_STAGED with ``lost`` (it restarted after staging, or after applying but before
    # the restore was published) gets REDO_RESTORE, re-reads and verifies its rows from the
    # dump, then APPLY_STAGED again. See docs/data_dump.md, "Roll-forward from the dump".

    def _apply_everywhere(self, plan, rec: dict | None = None) -> list[int]:
        """Roll every unit of a committing restore forward (:data:`tqtx.states.ROLL_FORWARD`):
        APPLY_STAGED; a unit that answers ``lost`` gets REDO_RESTORE, then APPLY_STAGED
        again. Returns the units that have not applied (unreachable or not registered);
        ``plan.redo_failed`` names those the dump could not serve. ``rec``: the restore's
        journal record, if at hand."""
        rid = plan.restore_id
        if rec is None:
            rec = self.journal.get_restore(rid)
        # Units journaled applied are asked again: one that restarted since answers lost.
        # A unit found lost by an earlier roll-forward starts at its redo.
        roll = {u["unit_id"]: st.REDOING if plan.roll.get(u["unit_id"]) == st.REDOING
                else st.APPLYING for u in rec["units"] if u["state"] in (st.STAGED, st.APPLIED)}
        redo_rid = new_id()  # fresh per roll-forward, so a repaired dump is read again
        plan.redo_failed.clear()
        plan.last_error = {}
        failures: dict[int, int] = {}

        def move(uid: int, to: str) -> None:
            st.check(st.ROLL_FORWARD, roll[uid], to, subject=f"restore {rid}: unit {uid}")
            roll[uid] = to

        for u in roll:
            if u not in self.unit_peers:
                move(u, st.UNREACHABLE)
        for _round in range(12):  # bounded: each unit needs at most apply, redo, apply + retries
            calls = []
            for u, state in roll.items():
                if state == st.REDOING:
                    items = plan.redo_items(u, self.num_units)
                    if items is None:
                        plan.redo_failed[u] = ("the client that began this restore did not "
                                               "send the rows' source indexes")
                        move(u, st.REDO_FAILED)
                        continue
                    calls.append((u, "REDO_RESTORE", {
                        "restore_id": rid, "dump_dir": plan.dump_dir, "dump_id": plan.dump_id,
                        "items": items, "field_schema": plan.field_schema}, redo_rid))
                elif state == st.APPLYING:
                    calls.append((u, "APPLY_STAGED", {"restore_id": rid},
                                  plan.apply_rids.setdefault(u, new_id())))
            if not calls:
                break
            redoing = any(op == "REDO_RESTORE" for _u, op, _b, _r in calls)
            results = call_many([(self.unit_peers[u], op, b, r) for u, op, b, r in calls],
                                raise_first=False, timeout=60 if redoing else 10)
            for (uid, op, _b, _r), res in zip(calls, results):
                if isinstance(res, BaseException):
                    plan.last_error[uid] = res
                    # a unit that does not even answer PING is down: leave it pending (the
                    # next FINISH_RESTORE, after it re-registers, rolls it forward)
                    failures[uid] = failures.get(uid, 0) + 1 if self._unit_answers(uid) else 3
                    if failures[uid] >= 3:
                        move(uid, st.UNREACHABLE)
                elif op == "REDO_RESTORE":
                    if res.get("failed"):
                        plan.redo_failed[uid] = res["failed"]
                        move(uid, st.REDO_FAILED)
                        self._note_recovery(rid, "unit-redo-failed", f"unit {uid}: "
                                            f"{plan.dump_dir}: {res['failed']}")
                    else:
                        move(uid, st.APPLYING)
                        plan.apply_rids[uid] = new_id()  # the old ID's reply was "lost"
                        if res.get("redone"):
                            self._note_recovery(rid, "unit-redone", f"unit {uid}: re-read "
                                                f"{res.get('rows')} rows from {plan.dump_dir}")
                elif res.get("lost"):
                    # The unit restarted after staging (or after applying): its memory is
                    # gone. The commit is decided and the dump is still there (its journal
                    # marks it being read): roll this unit forward from it.
                    log.warning("restore %s: unit %d lost its rows (restarted); rolling it "
                                "forward from %s", rid, uid, plan.dump_dir)
                    move(uid, st.REDOING)
                else:
                    self.journal.apply_unit(rid, uid)
                    faults.hit("controller.restore.after_apply")
                    move(uid, st.APPLIED)
        plan.roll = roll
        return [u for u, state in roll.items() if state in (st.APPLYING, st.REDOING,
                                                             st.UNREACHABLE)]

    def _unit_answers(self, uid: int) -> bool:
        try:
            self.unit_peers[uid].call("PING", timeout=2)
            return True
        except Exception:  # noqa: BLE001 - any failure means "not answering"
            return False

    def _note_recovery(self, rid: str, action: str, detail: str) -> None:
        log.info("restore %s: %s: %s", rid, action, detail)
        self.journal.record_recovery(incarnation_id=self.incarnation, kind="restore",
                                     target=rid, action=action, detail=detail[:2000])

    def _give_up(self, plan) -> None:
        """End a committing restore that cannot be rolled forward as ``failed``: nothing of
        it is published; rows already applied at its new (reserved) indexes are dropped."""
        rid = plan.restore_id
        rec = self.journal.get_restore(rid)
        reason = f"{rec.get('reason') or st.REDO_FAILED}; given up (recover_data_load cancel=True)"
        self.journal.finish_restore(rid, st.FAILED, reason[:2000])
        by_unit: dict[int, dict] = {}
        for r in plan.rows:
            if r.is_new:
                drop = by_unit.setdefault(owner(r.index, self.num_units),
                                          {"indexes": [], "gens": []})
                drop["indexes"].append(r.index)
                drop["gens"].append(r.gen)
        calls = [(self.unit_peers[u], "DROP_STAGED", {"restore_id": rid})
                 for u in plan.units if u in self.unit_peers]
        calls += [(self.unit_peers[u], "DROP_ROWS", drop)
                  for u, drop in sorted(by_unit.items()) if u in self.unit_peers]
        if calls:
            call_many(calls, raise_first=False, timeout=3)
        self._release(plan)
        self.restores.pop(rid, None)
        log.error("restore %s: failed (%s)", rid, reason)
