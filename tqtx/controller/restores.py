"""The controller's side of a transactional restore, top to bottom.

The protocol (docs/data_dump.md, "Restore"; journal states in :mod:`tqtx.states`), as
:class:`RestoreCoordinator` carries it out::

    begin_restore       # BEGIN_RESTORE: check the dump's schemas, plan every key (existing
                        # index, or a new one reserved and invisible), journal an ``active``
                        # restore with one ``pending`` claim per unit that stages rows
    restore_unit        # RESTORE_UNIT: a unit claims (``claimed``), loads and stages its
                        # rows, then reports ``staged`` (or ``failed``)
    finish_restore      # FINISH_RESTORE: the commit rule (tqtx.states.restore_decision)
                        # says commit, wait or abort
      _commit           #   journal the decision (``committing``, with the encoded plan),
                        #   every unit applies, then the metadata is published (``committed``)
      _abort            #   journal the outcome, units drop their staged rows, the
                        #   reservations are released
    _apply_everywhere   # the roll-forward: APPLY_STAGED; a unit that lost its staged rows
                        # (it restarted) re-reads them from the dump (REDO_RESTORE) first
    resume              # after a controller restart: a ``committing`` restore is rebuilt
                        # from its stored plan (tqtx.controller.startup), and the next
                        # FINISH_RESTORE (``recover_data_load``) rolls it forward

The coordinator holds the open plans; the rest of the controller asks it only whether a
partition is being restored into (:meth:`RestoreCoordinator.loading_into`) and for the
refusal of a change meanwhile (:meth:`RestoreCoordinator.refuse`).
"""
from __future__ import annotations

import logging
from typing import Callable

from .. import faults
from .. import states as st
from ..errors import RestorePendingError, SchemaConflictError
from ..journal.controller import ControllerJournal
from ..plan import BeginRow, RestorePlan, RestoreRow
from ..process.gcpause import gc_paused
from ..routing import owner
from ..states import IllegalTransition
from ..wire.rpc import new_id
from .metadata import Metadata
from .units import UnitPeers

log = logging.getLogger("tqtx.controller")


class RestoreCoordinator:
    """Handlers of BEGIN_RESTORE, RESTORE_UNIT, FINISH_RESTORE, LIST_RESTORES, GET_RESTORE
    and VALIDATE_DUMP_SCHEMA; the open restores' plans.

    ``store_plans``: the plan is journaled with the commit decision (metadata is journaled).
    ``require_units(what)`` raises while a replayed buffer waits for its units;
    ``topology()``: the topology incarnation; ``defer(fn)``: run ``fn`` between requests;
    ``apply_timeout``: seconds a unit has to answer APPLY_STAGED."""

    def __init__(self, *, meta: Metadata, journal: ControllerJournal, units: UnitPeers,
                 num_units: int, incarnation: int, store_plans: bool,
                 require_units: Callable[[str], None], topology: Callable[[], int],
                 defer: Callable[[Callable[[], object]], None], apply_timeout: float = 10.0):
        self.meta, self.journal, self.units, self.num_units = meta, journal, units, num_units
        self.incarnation, self.store_plans = incarnation, store_plans
        self.require_units, self.topology, self.defer = require_units, topology, defer
        self.apply_timeout = apply_timeout
        self.plans: dict[str, RestorePlan] = {}  # unresolved restores, by restore ID
        # run before a publish journals keys: metadata the journal still holds elsewhere
        # is written first (KVRequests.journal_checkpoint_keys)
        self.before_publish: Callable[[], None] = lambda: None

    # ---------------------------------------------------------------- begin
    def validate_dump_schema(self, body, req):
        """SchemaConflictError if a field of the dump has a schema the partition's refuses."""
        pid = body["partition_id"]
        try:
            self.meta.validate_schemas(self.meta.partition(pid), body["field_schema"])
        except SchemaConflictError as exc:
            raise SchemaConflictError(f"dump is incompatible with partition {pid!r}: "
                                      f"{exc}") from None
        return {"ok": True}

    @gc_paused  # a plan row per key, no cycles
    def begin_restore(self, body, req):
        """Resolve keys, reserve new indexes (invisible) and journal one pending claim per unit."""
        rid, pid = body["restore_id"], body["partition_id"]
        existing = self.plans.get(rid)
        if existing is not None:
            return self._plan_reply(existing)
        self.require_units("BEGIN_RESTORE")
        rec = self.journal.get_restore(rid)
        if rec is not None:
            raise RuntimeError(f"restore {rid} already ended: {rec['state']}")
        self.refuse(f"a second load into partition {pid!r}", pid)
        self.validate_dump_schema(body, req)
        plan = self._plan(rid, pid, body)
        try:
            self.journal.begin_restore(
                restore_id=rid, partition_id=pid, dump_dir=plan.dump_dir, dump_id=plan.dump_id,
                incarnation_id=self.incarnation, units=plan.units, keys=len(plan.rows),
                rows=sum(1 for r in plan.rows if r.fields), bytes=int(body.get("bytes", 0)))
        except BaseException:
            self._release(plan)
            raise
        self.plans[rid] = plan
        if self.store_plans:  # encoded while the units load, not in FINISH_RESTORE
            self.defer(plan.encode)
        log.info("restore %s: begun for partition %r from %s (%d keys, %d new, units %s)",
                 rid, pid, plan.dump_dir, len(plan.rows), len(plan.new_indexes), plan.units)
        faults.hit("controller.restore.after_begin")
        return self._plan_reply(plan)

    def _plan(self, rid: str, pid: str, body: dict) -> RestorePlan:
        """Every key of BEGIN_RESTORE at its index (new keys at new, reserved indexes)."""
        part = self.meta.partition(pid)
        wanted = [BeginRow.from_wire(r) for r in body["rows"]]
        new_keys = [r.key for r in wanted if part is None or r.key not in part.keys]
        new_idx, new_gens = self.meta.allocate_rows(len(new_keys))
        new_map = dict(zip(new_keys, zip(new_idx, new_gens)))
        rows, units = [], set()
        for r in wanted:
            # src lets a unit that lost its staged rows re-read them after the commit decision
            new = new_map.get(r.key)
            if new is None:
                idx = part.keys[r.key]
                row = RestoreRow(r.key, idx, r.fields, r.tag, False, self.meta.gens[idx], r.src)
            else:
                row = RestoreRow(r.key, new[0], r.fields, r.tag, True, new[1], r.src)
            rows.append(row)
            if row.fields:
                units.add(owner(row.index, self.num_units))
        self.meta.reserve(rid, new_idx)
        return RestorePlan(rid, pid, body["dump_dir"], rows, body["field_schema"], sorted(units),
                           new_idx, body.get("dump_id"))

    def _plan_reply(self, plan: RestorePlan) -> dict:
        return {"restore_id": plan.restore_id, "indexes": [r.index for r in plan.rows],
                "new": [r.is_new for r in plan.rows], "gens": [r.gen for r in plan.rows],
                "units": plan.units, "num_units": self.num_units,
                "incarnation": self.incarnation, "topology": self.topology()}

    def _release(self, plan: RestorePlan) -> None:
        self.meta.unreserve(plan.new_indexes, free=True)

    # ---------------------------------------------------------------- per-unit claims
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
        if action != st.FAILED:
            raise ValueError(f"unknown RESTORE_UNIT action {action!r}")
        try:
            if rec["state"] == st.ACTIVE:
                self.journal.fail_unit(rid, uid, str(body.get("error", ""))[:2000])
        except IllegalTransition as exc:
            raise RuntimeError(str(exc)) from None
        log.warning("restore %s: unit %d failed: %s", rid, uid, body.get("error"))
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

    # ---------------------------------------------------------------- finish
    @gc_paused
    def finish_restore(self, body, req):
        """Commit (decision journaled first, then units apply, then metadata) or abandon."""
        rid = body["restore_id"]
        plan = self.plans.get(rid)
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
            states = st.unit_states(rec)
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
        outcome = st.CANCELLED if body.get("cancel") else st.ABORTED
        self._abort(rid, plan, outcome, body.get("reason") or outcome)
        return self._outcome(self.journal.get_restore(rid))

    def _outcome(self, rec: dict) -> dict:
        return {"restore_id": rec["restore_id"], "outcome": rec["outcome"] or rec["state"],
                "reason": rec["reason"], "state": rec["state"], "units": st.unit_states(rec),
                "keys": rec["keys"], "rows": rec["rows"], "bytes": rec["bytes"]}

    def _commit(self, plan: RestorePlan) -> dict:
        """Roll a restore forward: decision (journaled; repeating it is a no-op), then every
        unit applies, then metadata; returns the committed restore's record.

        Once decided, a commit only moves forward. An apply that fails or gets no reply is
        retried with the same request ID (so a unit applies once); if a unit still has not
        applied, the restore stays ``committing`` with metadata unpublished, and the next
        FINISH_RESTORE (``recover_data_load``) continues from the journal.
        """
        rid = plan.restore_id
        rec = self.journal.decide_commit(rid, plan.encode() if self.store_plans else None)
        log.info("restore %s: commit decided", rid)
        faults.hit("controller.restore.after_commit_decision")
        todo = self._apply_everywhere(plan, rec)
        if plan.redo_failed:
            why = "; ".join(f"unit {u}: {w}" for u, w in sorted(plan.redo_failed.items()))
            reason = f"{st.REDO_FAILED}: {plan.dump_dir}: {why}"
            rec = self.journal.note_reason(rid, reason[:2000])
            log.error("restore %s: commit decided but cannot be rolled forward: %s", rid, reason)
            raise RestorePendingError(
                f"restore {rid}: the commit is decided, but unit(s) {sorted(plan.redo_failed)} "
                f"restarted without their staged rows and the dump cannot provide them again "
                f"({reason}). No key of this restore is visible. Put the dump back in place "
                f"and run tqtx.recover_data_load({plan.dump_dir!r}) to roll it forward, or "
                f"tqtx.recover_data_load({plan.dump_dir!r}, cancel=True) to end it as failed.",
                restore_id=rid, dump_dir=plan.dump_dir, reason=st.REDO_FAILED,
                units=st.unit_states(rec), partition_id=plan.partition_id)
        if todo:
            rec = self.journal.get_restore(rid)
            detail = "; ".join(f"unit {u}: {plan.last_error.get(u, 'not registered')}"
                               for u in todo)
            log.error("restore %s: commit decided but units %s have not applied: %s", rid, todo,
                      detail)
            raise RestorePendingError(
                f"restore {rid}: the commit is decided but unit(s) {todo} have not applied "
                f"their staged rows yet ({detail}); the restore stays unresolved and "
                f"tqtx.recover_data_load({plan.dump_dir!r}) rolls it forward",
                restore_id=rid, dump_dir=plan.dump_dir, reason=st.APPLY_PENDING,
                units=st.unit_states(rec), partition_id=plan.partition_id)
        change, schema = self.meta.plan_publish(plan.partition_id, plan.rows, plan.field_schema)
        # The published metadata and the end of the restore are one journal transaction.
        self.before_publish()
        faults.hit("controller.meta.restore_publish.before_commit")
        done = self.journal.finish_restore(rid, st.COMMITTED, None,
                                           meta_change=change if self.store_plans else None)
        faults.hit("controller.meta.restore_publish.after_commit")
        self.meta.apply_publish(plan.partition_id, change, schema)
        self.meta.unreserve(plan.new_indexes, free=False)
        self.plans.pop(rid, None)
        faults.hit("controller.restore.after_publish")
        faults.hit("controller.meta.restore_publish.before_reply")
        log.info("restore %s: committed (%d keys)", rid, len(plan.rows))
        return done

    def _abort(self, rid: str, plan: RestorePlan | None, outcome: str, reason: str) -> None:
        rec = self.journal.get_restore(rid)
        self.journal.finish_restore(rid, outcome, reason)
        try:
            faults.hit("controller.restore.after_abort_decision")
        finally:  # decided: an error from here on must not keep the staged rows
            self._drop_aborted(rid, rec, plan)
        log.warning("restore %s: %s (%s)", rid, outcome, reason)

    def _drop_aborted(self, rid: str, rec: dict, plan: RestorePlan | None) -> None:
        """After an abort is journaled: the units drop the staged rows, the reservations go."""
        live = [u["unit_id"] for u in rec["units"] if u["unit_id"] in self.units]
        if live:
            self.units.call([(u, "DROP_STAGED", {"restore_id": rid}) for u in live], timeout=3)
        if plan is not None:
            self._release(plan)
            self.plans.pop(rid, None)

    def list_restores(self, body, req):
        pid = body.get("partition_id")
        return {"restores": [rec for rec in self.journal.unresolved_restores()
                             if pid is None or rec["partition_id"] == pid]}

    def get_restore(self, body, req):
        return {"restore": self.journal.get_restore(body["restore_id"])}

    # ---------------------------------------------------------------- roll-forward
    # After the commit decision the dump is the restore's redo log: a unit that answers
    # APPLY_STAGED with ``lost`` (it restarted after staging, or after applying but before
    # the restore was published) gets REDO_RESTORE, re-reads and verifies its rows from the
    # dump, then APPLY_STAGED again. See docs/data_dump.md, "Roll-forward from the dump".

    def _apply_everywhere(self, plan: RestorePlan, rec: dict | None = None) -> list[int]:
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
        roll = {u: st.REDOING if plan.roll.get(u) == st.REDOING else st.APPLYING
                for u, state in st.unit_states(rec).items() if state in (st.STAGED, st.APPLIED)}
        redo_rid = new_id()  # fresh per roll-forward, so a repaired dump is read again
        plan.redo_failed.clear()
        plan.last_error = {}
        failures: dict[int, int] = {}

        def move(uid: int, to: str) -> None:
            st.check(st.ROLL_FORWARD, roll[uid], to, subject=f"restore {rid}: unit {uid}")
            roll[uid] = to

        for u in roll:
            if u not in self.units:
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
                        "items": [i.to_wire() for i in items],
                        "field_schema": plan.field_schema}, redo_rid))
                elif state == st.APPLYING:
                    calls.append((u, "APPLY_STAGED", {"restore_id": rid},
                                  plan.apply_rids.setdefault(u, new_id())))
            if not calls:
                break
            # a redo re-reads the dump; an apply waits, with durability sync, for the fsync
            # of every row it applied
            redoing = any(op == "REDO_RESTORE" for _u, op, _b, _r in calls)
            results = self.units.call(calls, timeout=60 if redoing else self.apply_timeout)
            for (uid, op, _b, _r), res in zip(calls, results):
                if isinstance(res, BaseException):
                    plan.last_error[uid] = res
                    # a unit that does not even answer PING is down: leave it pending (the
                    # next FINISH_RESTORE, after it re-registers, rolls it forward)
                    failures[uid] = failures.get(uid, 0) + 1 if self.units.answers(uid) else 3
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
        unfinished = (st.APPLYING, st.REDOING, st.UNREACHABLE)
        return [u for u, state in roll.items() if state in unfinished]

    def _note_recovery(self, rid: str, action: str, detail: str) -> None:
        log.info("restore %s: %s: %s", rid, action, detail)
        self.journal.record_recovery(incarnation_id=self.incarnation, kind="restore",
                                     target=rid, action=action, detail=detail[:2000])

    def _give_up(self, plan: RestorePlan) -> None:
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
        calls = [(u, "DROP_STAGED", {"restore_id": rid}) for u in plan.units if u in self.units]
        calls += [(u, "DROP_ROWS", drop) for u, drop in sorted(by_unit.items())
                  if u in self.units]
        if calls:
            self.units.call(calls, timeout=3)
        self._release(plan)
        self.plans.pop(rid, None)
        log.error("restore %s: failed (%s)", rid, reason)

    # ---------------------------------------------------------------- after a restart
    def resume(self, plan: RestorePlan) -> None:
        """Hold a ``committing`` restore an earlier incarnation left, from its stored plan:
        its new indexes are reserved again until the roll-forward publishes them."""
        self.plans[plan.restore_id] = plan
        gen_of = {r.index: r.gen for r in plan.rows}
        self.meta.reserve(plan.restore_id, plan.new_indexes, [gen_of[i] for i in plan.new_indexes])

    # ---------------------------------------------------------------- what others ask
    def __len__(self) -> int:
        return len(self.plans)

    def __contains__(self, restore_id: str) -> bool:
        return restore_id in self.plans

    def loading_into(self, pid: str) -> bool:
        """Whether an unresolved restore loads into partition ``pid``."""
        return self._unresolved_in(pid) is not None

    def refuse(self, what: str, pid: str | None = None) -> None:
        """RestorePendingError refusing ``what`` if a restore into ``pid`` (any partition
        when None) is unresolved."""
        plan = next(iter(self.plans.values()), None) if pid is None else self._unresolved_in(pid)
        if plan is not None:
            raise self._pending_error(plan, what)

    def _unresolved_in(self, pid: str) -> RestorePlan | None:
        for plan in self.plans.values():
            if plan.partition_id == pid:
                return plan
        return None

    def _pending_error(self, plan: RestorePlan, what: str) -> RestorePendingError:
        rec = self.journal.get_restore(plan.restore_id) or {}
        units = st.unit_states(rec)
        reason = st.pending_reason(units.values())
        if str(rec.get("reason") or "").startswith(st.REDO_FAILED):
            reason = st.REDO_FAILED
        err = RestorePendingError(restore_id=plan.restore_id, dump_dir=plan.dump_dir,
                                  reason=reason, units=units, partition_id=plan.partition_id)
        return RestorePendingError(f"{what} refused: {err.describe()}", restore_id=plan.restore_id,
                                   dump_dir=plan.dump_dir, reason=reason, units=units,
                                   partition_id=plan.partition_id)
