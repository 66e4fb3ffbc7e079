"""Roll a committed restore forward on every unit, from the dump where a unit lost its rows.

Mixed into :class:`tqtx.controller.server.Controller` (uses its journal, unit peers and
incarnation). After the commit decision the dump is the restore's redo log: a unit that
answers APPLY_STAGED with ``lost`` (it restarted after staging, or after applying but
before the restore was published) gets REDO_RESTORE, re-reads and verifies its rows from
the dump, then APPLY_STAGED again. See docs/data_dump.md, "Roll-forward from the dump".
"""
from __future__ import annotations

import logging

from .. import faults
from ..wire.rpc import call_many, new_id

log = logging.getLogger("tqtx.controller")


class RollForward:
    """Controller methods for applying a committing restore everywhere (or giving it up)."""

    def _apply_everywhere(self, plan) -> list[int]:
        """APPLY_STAGED on every unit of a committing restore, rolling forward from the dump
        (REDO_RESTORE, then APPLY_STAGED) each unit that answers ``lost``. Returns the units
        that have not applied (not registered or not answering); ``plan.redo_failed`` names
        those the dump could not serve."""
        rid = plan.restore_id
        rec = self.journal.get_restore(rid)
        # Units journaled applied are asked again: one that restarted since answers lost.
        todo = [u["unit_id"] for u in rec["units"] if u["state"] in ("staged", "applied")]
        redo_rid = new_id()  # fresh per roll-forward, so a repaired dump is read again
        plan.redo_failed.clear()
        plan.last_error = {}
        failures: dict[int, int] = {}
        for _round in range(12):  # bounded: each unit needs at most apply, redo, apply + retries
            live = [u for u in todo if u in self.unit_peers and failures.get(u, 0) < 3
                    and u not in plan.redo_failed]
            if not live:
                break
            calls, done = [], set()
            for u in live:
                if u in plan.redo:
                    items = plan.redo_items(u, self.num_units)
                    if items is None:
                        plan.redo_failed[u] = ("the client that began this restore did not "
                                               "send the rows' source indexes")
                        continue
                    calls.append((u, "REDO_RESTORE", {
                        "restore_id": rid, "dump_dir": plan.dump_dir, "dump_id": plan.dump_id,
                        "items": items, "field_schema": plan.field_schema}, redo_rid))
                else:
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
                elif op == "REDO_RESTORE":
                    if res.get("failed"):
                        plan.redo_failed[uid] = res["failed"]
                        self._note_recovery(rid, "unit-redo-failed", f"unit {uid}: "
                                            f"{plan.dump_dir}: {res['failed']}")
                    else:
                        plan.redo.discard(uid)
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
                    plan.redo.add(uid)
                else:
                    self.journal.apply_unit(rid, uid)
                    faults.hit("controller.restore.after_apply")
                    done.add(uid)
            todo = [u for u in todo if u not in done]
        return [u for u in todo if u not in plan.redo_failed]

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
        reason = f"{rec.get('reason') or 'redo_failed'}; given up (recover_data_load cancel=True)"
        self.journal.finish_restore(rid, "failed", reason[:2000])
        by_unit: dict[int, list[int]] = {}
        for idx in plan.new_indexes:
            by_unit.setdefault(idx % self.num_units, []).append(idx)
        calls = [(self.unit_peers[u], "DROP_STAGED", {"restore_id": rid})
                 for u in plan.units if u in self.unit_peers]
        calls += [(self.unit_peers[u], "DROP_ROWS", {"indexes": idx})
                  for u, idx in sorted(by_unit.items()) if u in self.unit_peers]
        if calls:
            call_many(calls, raise_first=False, timeout=3)
        self._release(plan)
        self.restores.pop(rid, None)
        log.error("restore %s: failed (%s)", rid, reason)
