"""The controller process: metadata, restore decisions and the controller journal.

One ROUTER socket, one thread. It never touches payload bytes: units hold them.
"""
from __future__ import annotations

import logging
import os
import socket
import time

from .. import __version__, faults
from ..errors import (FieldsNotFoundError, KeysNotFoundError, PartitionNotFoundError,
                      RestorePendingError, SchemaConflictError, StateDirInUseError)
from ..journal.store import ControllerJournal, IllegalTransition, controller_lock_path
from ..wire.rpc import CONNECT_TIMEOUT, Peer, Server, call_many
from .metadata import Metadata, check_schema_compatible, merge_schema
from .rollforward import RollForward

log = logging.getLogger("tqtx.controller")

FINAL = {"committed", "aborted", "cancelled", "failed"}


_RESTORE_UNIT_ACTIONS = {"claim", "staged", "failed"}


def _restore_unit_label(body) -> str:
    action = body.get("action") if isinstance(body, dict) else None
    return f"RESTORE_UNIT:{action if action in _RESTORE_UNIT_ACTIONS else 'other'}"


class RestorePlan:
    """In-memory side of an unresolved restore (the journal holds its state)."""

    def __init__(self, restore_id, partition_id, dump_dir, rows, field_schema, units, new_indexes,
                 srcs=None, dump_id=None):
        self.restore_id = restore_id
        self.partition_id = partition_id
        self.dump_dir = dump_dir
        self.rows = rows                  # [key, dest_index, fields, tag, is_new]
        self.field_schema = field_schema
        self.units = units
        self.new_indexes = new_indexes
        self.srcs = srcs or [None] * len(rows)  # per row: its global index in the dump
        self.dump_id = dump_id
        self.apply_rids: dict[int, str] = {}
        self.redo: set[int] = set()             # units to roll forward from the dump
        self.redo_failed: dict[int, str] = {}   # unit -> why the dump could not provide
        self.last_error: dict[int, BaseException] = {}

    def redo_items(self, uid: int, num_units: int) -> list | None:
        """[dest, fresh, src] of the rows unit ``uid`` holds; None if a source is unknown."""
        items = []
        for (_key, idx, fields, _tag, is_new), src in zip(self.rows, self.srcs):
            if fields and idx % num_units == uid:
                if src is None:
                    return None
                items.append([idx, is_new, src])
        return items


def acquire_state_dir(state_dir: str):
    """Take exclusive ownership of ``state_dir`` or raise StateDirInUseError."""
    import filelock

    os.makedirs(state_dir, exist_ok=True)
    lock = filelock.FileLock(os.fspath(controller_lock_path(state_dir)))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        owner = ""
        try:
            with open(os.path.join(state_dir, "controller.owner")) as f:
                owner = f.read().strip()
        except OSError:
            pass
        raise StateDirInUseError(
            f"state dir {state_dir} is in use by another running controller ({owner or 'unknown'}); "
            f"stop it or choose another state_dir") from None
    return lock


class Controller(RollForward):
    def __init__(self, *, num_units: int, state_dir: str, host: str = "127.0.0.1", port: int = 0,
                 curve=None, client_curve=None):
        self.num_units = num_units
        self.state_dir = os.path.abspath(state_dir)
        self.lock = acquire_state_dir(self.state_dir)
        self.server = Server("controller", host, port, curve=curve)
        self.address = self.server.address
        self.client_curve = client_curve
        with open(os.path.join(self.state_dir, "controller.owner"), "w") as f:
            f.write(f"pid {os.getpid()} on {socket.gethostname()} at {self.address}")
        self.journal = ControllerJournal(self.state_dir)
        self.incarnation = self.journal.start_incarnation(
            pid=os.getpid(), host=socket.gethostname(), address=self.address, version=__version__)
        from ..journal.recovery import recover_controller_journal
        self.recovered = recover_controller_journal(self.journal, incarnation_id=self.incarnation)
        for event in self.recovered:
            log.warning("startup recovery: %s %s: %s %s", event.get("kind"), event.get("target"),
                        event.get("action"), event.get("detail", ""))
        self.meta = Metadata()
        self.units: dict[int, str] = {}
        # Topology incarnation: changes whenever a unit (re-)registers at a new address;
        # replies that lead a client to units carry it ("topology"). The controller
        # incarnation in the high bits keeps it distinct across controller restarts.
        self.topology_incarnation = self.incarnation << 32
        self.unit_peers: dict[int, Peer] = {}
        self.restores: dict[str, RestorePlan] = {}
        self.started = time.time()
        self.counters: dict[str, int] = {}
        s = self.server
        for op, fn, mutating in [
            ("PING", self.ping, False), ("REGISTER_UNIT", self.register_unit, True),
            ("TOPOLOGY", self.topology, False), ("ALLOC", self.alloc, True),
            ("COMMIT_PUT", self.commit_put, True), ("LOOKUP", self.lookup, False),
            ("LIST", self.list_keys, False), ("CLEAR", self.clear, True),
            ("DESCRIBE_ROWS_BY_KEY", self.describe_rows, False),
            ("RECORD_DUMP", self.record_dump, True),
            ("VALIDATE_DUMP_SCHEMA", self.validate_dump_schema, False),
            ("BEGIN_RESTORE", self.begin_restore, True), ("RESTORE_UNIT", self.restore_unit, True),
            ("FINISH_RESTORE", self.finish_restore, True), ("LIST_RESTORES", self.list_restores, False),
            ("GET_RESTORE", self.get_restore, False),
            ("CHECKPOINT_SNAPSHOT", self.checkpoint_snapshot, False),
            ("CHECKPOINT_REPLACE", self.checkpoint_replace, True),
            ("STATS", self.stats, False), ("GET_STATS", self.stats, False),
            ("SHUTDOWN", self.shutdown, True),
        ]:
            s.add(op, fn, mutating=mutating)
        # restore claims are counted per action: RESTORE_UNIT:claim / :staged / :failed
        s.op_labels["RESTORE_UNIT"] = _restore_unit_label
        s.metrics.gauge("rows_held", self._keys_held)
        s.metrics.gauge("bytes_held", lambda: 0)
        s.metrics.gauge("open_restores", lambda: len(self.restores))

    # ---------------------------------------------------------------- basics
    def ping(self, body, req):
        return {"incarnation": self.incarnation}

    def register_unit(self, body, req):
        uid = int(body["unit_id"])
        if not 0 <= uid < self.num_units:
            raise ValueError(f"unit id {uid} outside 0..{self.num_units - 1}")
        if self.units.get(uid) != body["address"]:
            self.topology_incarnation += 1
        self.units[uid] = body["address"]
        old = self.unit_peers.pop(uid, None)
        if old is not None:
            old.close()
        self.unit_peers[uid] = Peer(body["address"], f"unit {uid}", timeout=120,
                                    curve=self.client_curve, connect_timeout=CONNECT_TIMEOUT)
        log.info("unit %d registered at %s (topology %d)", uid, body["address"],
                 self.topology_incarnation & 0xFFFFFFFF)
        return {"incarnation": self.incarnation}

    def topology(self, body, req):
        ready = len(self.units) == self.num_units
        return {"ready": ready, "num_units": self.num_units,
                "units": [self.units.get(i) for i in range(self.num_units)],
                "incarnation": self.incarnation, "state_dir": self.state_dir,
                "topology": self.topology_incarnation,
                "version": __version__, "address": self.address,
                "metrics_endpoint": getattr(self, "metrics_endpoint", None)}

    def shutdown(self, body, req):
        self.server.stop()
        return {"ok": True}

    def _unresolved_in(self, pid: str):
        for plan in self.restores.values():
            if plan.partition_id == pid:
                return plan
        return None

    def _pending_error(self, plan: RestorePlan, what: str) -> RestorePendingError:
        rec = self.journal.get_restore(plan.restore_id) or {}
        units = {u["unit_id"]: u["state"] for u in rec.get("units", [])}
        reason = "unit_running" if "claimed" in units.values() else "in_progress"
        if str(rec.get("reason") or "").startswith("redo_failed"):
            reason = "redo_failed"
        err = RestorePendingError(restore_id=plan.restore_id, dump_dir=plan.dump_dir,
                                  reason=reason, units=units, partition_id=plan.partition_id)
        return RestorePendingError(f"{what} refused: {err.describe()}", restore_id=plan.restore_id,
                                   dump_dir=plan.dump_dir, reason=reason, units=units,
                                   partition_id=plan.partition_id)

    # ---------------------------------------------------------------- kv
    def alloc(self, body, req):
        """Resolve keys to indexes (allocating new ones) after validating schemas."""
        pid, keys, schemas = body["partition_id"], body["keys"], body.get("schemas") or {}
        part = self.meta.partition(pid)
        self.meta.validate_schemas(part, schemas)
        new_keys = [k for k in keys if part is None or k not in part.keys]
        plan = self._unresolved_in(pid)
        if new_keys and plan is not None:
            raise self._pending_error(plan, f"creating keys in partition {pid!r}")
        part = self.meta.partition(pid, create=True)
        # Register new fields' schemas now, so a concurrent put of the same field with
        # another dtype is refused here, before it writes anything.
        for field, schema in schemas.items():
            part.schema[field] = merge_schema(part.schema.get(field), schema)
        fresh_idx = self.meta.allocate(len(new_keys))
        for key, idx in zip(new_keys, fresh_idx):
            part.keys[key] = idx
            part.fields[idx] = set()
            part.tags[key] = {}
        return {"indexes": [part.keys[k] for k in keys], "fresh": fresh_idx,
                "topology": self.topology_incarnation}

    def commit_put(self, body, req):
        """Publish the fields (and merge the tags) of rows the units now hold.

        The fields' schemas were validated and merged by ALLOC, before any unit wrote.
        """
        pid = body["partition_id"]
        part = self.meta.require(pid)
        keys, fields, tags = body["keys"], body.get("fields") or [], body.get("tags")
        common = None
        for i, key in enumerate(keys):
            idx = part.keys.get(key)
            if idx is None:
                raise KeysNotFoundError([key], pid)
            produced = part.fields.setdefault(idx, set())
            produced.update(fields)
            if tags is not None and tags[i]:
                part.tags.setdefault(key, {}).update(tags[i])
            common = set(produced) if common is None else common & produced
        return {"fields": sorted(common or ())}

    def lookup(self, body, req):
        """Indexes, fields and schemas of ``keys``. With ``lenient`` (TransferQueue's
        results): unknown keys and fields not produced for every key are left out."""
        pid, keys, select = body["partition_id"], body["keys"], body.get("select_fields")
        lenient = bool(body.get("lenient"))
        part = self.meta.partition(pid)
        if part is None or (lenient and not any(k in part.keys for k in keys)):
            raise KeysNotFoundError(keys, pid)
        if lenient:
            keys = [k for k in keys if k in part.keys]
            if select is not None:
                select = [f for f in select
                          if all(f in part.fields.get(part.keys[k], ()) for k in keys)]
        indexes = part.indexes_of(keys)
        if select is None:
            common = None
            for idx in indexes:
                f = part.fields.get(idx, set())
                common = set(f) if common is None else common & f
            fields = sorted(common or ())
            fields = [f for f in part.schema if f in set(fields)]
        else:
            fields = list(select)
            for f in fields:
                lacking = [k for k, i in zip(keys, indexes) if f not in part.fields.get(i, ())]
                if lacking:
                    shown = ", ".join(repr(k) for k in lacking[:10])
                    raise FieldsNotFoundError(
                        f"select_fields: field {f!r} not found: it was not produced for keys "
                        f"{shown} in partition {pid!r}")
        return {"indexes": indexes, "fields": fields, "keys": keys,
                "schemas": {f: part.schema[f] for f in fields}, "num_units": self.num_units,
                "topology": self.topology_incarnation}

    def list_keys(self, body, req):
        pid = body.get("partition_id")
        parts = [self.meta.partitions[pid]] if pid in self.meta.partitions else (
            [] if pid is not None else list(self.meta.partitions.values()))
        return {p.pid: {k: p.tags.get(k, {}) for k in p.keys} for p in parts}

    def clear(self, body, req):
        pid = body["partition_id"]
        plan = self._unresolved_in(pid)
        if plan is not None:
            raise self._pending_error(plan, f"clearing partition {pid!r}")
        part = self.meta.partition(pid)
        if part is None:
            return {"freed": []}
        return {"freed": self.meta.clear(part, body["keys"])}

    # ---------------------------------------------------------------- dump
    def describe_rows(self, body, req):
        """Per key (in request order): global index, produced fields and tag, plus the
        fields' schemas. No payload. Columnar: ``fields_of[i]`` indexes ``field_sets``."""
        pid, keys = body["partition_id"], body["keys"]
        part = self.meta.partition(pid)
        if part is None:
            if not keys:
                return {"indexes": [], "field_sets": [], "fields_of": [], "tags": [],
                        "field_schema": {}, "num_units": self.num_units,
                        "topology": self.topology_incarnation}
            raise PartitionNotFoundError(f"partition {pid!r} does not exist (not found)")
        indexes = part.indexes_of(keys)
        set_ids: dict[frozenset, int] = {}
        field_sets: list[list[str]] = []
        fields_of = []
        produced = part.fields
        for idx in indexes:
            fs = frozenset(produced.get(idx, ()))
            sid = set_ids.get(fs)
            if sid is None:
                sid = set_ids[fs] = len(field_sets)
                field_sets.append(sorted(fs))
            fields_of.append(sid)
        used = sorted(set().union(*field_sets)) if field_sets else []
        tags = part.tags
        return {"indexes": indexes, "field_sets": field_sets, "fields_of": fields_of,
                "tags": [tags.get(k) or {} for k in keys],
                "field_schema": {f: part.schema[f] for f in used}, "num_units": self.num_units,
                "topology": self.topology_incarnation}

    def record_dump(self, body, req):
        self.journal.record_dump(incarnation_id=self.incarnation, **body)
        log.info("dump %s: recorded (%s keys, %s bytes, %s shards) for partition %r at %s",
                 body.get("dump_id"), body.get("keys"), body.get("bytes"), body.get("shards"),
                 body.get("partition_id"), body.get("dump_dir"))
        return {"ok": True}

    def validate_dump_schema(self, body, req):
        part = self.meta.partition(body["partition_id"])
        if part is not None:
            for field, schema in body["field_schema"].items():
                old = part.schema.get(field)
                if old is not None:
                    try:
                        check_schema_compatible(field, old, schema)
                    except SchemaConflictError as exc:
                        raise SchemaConflictError(f"dump is incompatible with partition "
                                                  f"{body['partition_id']!r}: {exc}") from None
        return {"ok": True}

    # ---------------------------------------------------------------- restore
    def begin_restore(self, body, req):
        """Resolve keys, reserve new indexes (invisible) and journal one pending claim per unit."""
        rid, pid = body["restore_id"], body["partition_id"]
        existing = self.restores.get(rid)
        if existing is not None:
            return self._plan_reply(existing)
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
        new_idx = self.meta.allocate(len(new_keys))
        new_map = dict(zip(new_keys, new_idx))
        rows, units, srcs = [], set(), []
        for row in rows_in:
            key, fields, tag = row[:3]
            # [key, fields, tag, src]: src (the row's global index in the dump) lets a unit
            # that lost its staged rows re-read them after the commit decision
            srcs.append(int(row[3]) if len(row) > 3 and row[3] is not None else None)
            is_new = key in new_map
            idx = new_map[key] if is_new else part.keys[key]
            rows.append([key, idx, fields, tag, is_new])
            if fields:
                units.add(idx % self.num_units)
        for idx in new_idx:
            self.meta.reserved[idx] = rid
        plan = RestorePlan(rid, pid, body["dump_dir"], rows, body["field_schema"], sorted(units),
                           new_idx, srcs, body.get("dump_id"))
        try:
            self.journal.begin_restore(
                restore_id=rid, partition_id=pid, dump_dir=body["dump_dir"],
                dump_id=body.get("dump_id"), incarnation_id=self.incarnation, units=plan.units,
                keys=len(rows), rows=sum(1 for r in rows if r[2]), bytes=int(body.get("bytes", 0)))
        except BaseException:
            self._release(plan)
            raise
        self.restores[rid] = plan
        log.info("restore %s: begun for partition %r from %s (%d keys, %d new, units %s)",
                 rid, pid, plan.dump_dir, len(rows), len(new_idx), plan.units)
        faults.hit("controller.restore.after_begin")
        return self._plan_reply(plan)

    def _plan_reply(self, plan: RestorePlan) -> dict:
        return {"restore_id": plan.restore_id, "indexes": [r[1] for r in plan.rows],
                "new": [r[4] for r in plan.rows], "units": plan.units,
                "num_units": self.num_units, "incarnation": self.incarnation,
                "topology": self.topology_incarnation}

    def _release(self, plan: RestorePlan) -> None:
        for idx in plan.new_indexes:
            self.meta.reserved.pop(idx, None)
        self.meta.release(plan.new_indexes)

    def restore_unit(self, body, req):
        """A unit claims permission, reports its rows staged, or reports failure."""
        rid, uid, action = body["restore_id"], int(body["unit_id"]), body["action"]
        rec = self.journal.get_restore(rid)
        if rec is None:
            raise RuntimeError(f"restore {rid} is unknown to this controller")
        try:
            if action == "claim":
                if rec["state"] != "active":
                    raise RuntimeError(f"restore {rid} is {rec['state']}; unit {uid} may not load")
                self.journal.claim_unit(rid, uid)
                log.info("restore %s: unit %d claimed", rid, uid)
                faults.hit("controller.restore.after_claim")
            elif action == "staged":
                if rec["state"] != "active":
                    raise RuntimeError(f"restore {rid} is {rec['state']}; unit {uid} must drop its "
                                       f"staged rows")
                self.journal.stage_unit(rid, uid, rows=int(body.get("rows", 0)),
                                        bytes=int(body.get("bytes", 0)))
                log.info("restore %s: unit %d staged %s rows", rid, uid, body.get("rows"))
                faults.hit("controller.restore.after_staged")
            elif action == "failed":
                if rec["state"] == "active":
                    self.journal.fail_unit(rid, uid, str(body.get("error", ""))[:2000])
                log.warning("restore %s: unit %d failed: %s", rid, uid, body.get("error"))
            else:
                raise ValueError(f"unknown RESTORE_UNIT action {action!r}")
        except IllegalTransition as exc:
            raise RuntimeError(str(exc)) from None
        return {"ok": True}

    def finish_restore(self, body, req):
        """Commit (decision journaled first, then units apply, then metadata) or abandon."""
        rid = body["restore_id"]
        rec = self.journal.get_restore(rid)
        if rec is None:
            raise RuntimeError(f"restore {rid} is unknown to this controller")
        if rec["state"] in FINAL:
            return self._outcome(rec)
        plan = self.restores.get(rid)
        if rec["state"] == "committing":
            # The decision is journaled: whatever was asked, the only way is forward.
            if plan is None:
                raise RuntimeError(f"restore {rid} is committing but this controller has no "
                                   f"plan for it")
            try:
                self._commit(plan)
            except RestorePendingError as exc:
                if not (body.get("cancel") and exc.reason == "redo_failed"):
                    raise
                self._give_up(plan)
            return self._outcome(self.journal.get_restore(rid))
        commit = bool(body.get("commit"))
        if commit:
            states = {u["unit_id"]: u["state"] for u in rec["units"]}
            if any(s != "staged" for s in states.values()):
                if "claimed" in states.values():
                    raise RestorePendingError(
                        restore_id=rid, dump_dir=rec["dump_dir"], reason="unit_running",
                        units=states, partition_id=rec["partition_id"])
                commit = False
                body = {**body, "reason": body.get("reason") or
                        "not every unit staged its rows: " + ", ".join(
                            f"unit {u}: {s}" for u, s in sorted(states.items()))}
        if commit and plan is not None:
            self._commit(plan)
        else:
            outcome = "cancelled" if body.get("cancel") else "aborted"
            self._abort(rid, plan, outcome, body.get("reason") or outcome)
        return self._outcome(self.journal.get_restore(rid))

    def _outcome(self, rec: dict) -> dict:
        return {"restore_id": rec["restore_id"], "outcome": rec["outcome"] or rec["state"],
                "reason": rec["reason"], "state": rec["state"],
                "units": {u["unit_id"]: u["state"] for u in rec["units"]}, "keys": rec["keys"],
                "rows": rec["rows"], "bytes": rec["bytes"]}

    def _commit(self, plan: RestorePlan) -> None:
        """Roll a restore forward: decision, then every unit applies, then metadata.

        Once decided, a commit only moves forward. An apply that fails or gets no reply is
        retried with the same request ID (so a unit applies once); if a unit still has not
        applied, the restore stays ``committing`` with metadata unpublished, and the next
        FINISH_RESTORE (``recover_data_load``) continues from the journal.
        """
        rid = plan.restore_id
        self.journal.decide_commit(rid)
        log.info("restore %s: commit decided", rid)
        faults.hit("controller.restore.after_commit_decision")
        todo = self._apply_everywhere(plan)
        if plan.redo_failed:
            why = "; ".join(f"unit {u}: {w}" for u, w in sorted(plan.redo_failed.items()))
            reason = f"redo_failed: {plan.dump_dir}: {why}"
            rec = self.journal.note_reason(rid, reason[:2000])
            units = {u["unit_id"]: u["state"] for u in rec["units"]}
            log.error("restore %s: commit decided but cannot be rolled forward: %s", rid, reason)
            raise RestorePendingError(
                f"restore {rid}: the commit is decided, but unit(s) {sorted(plan.redo_failed)} "
                f"restarted without their staged rows and the dump cannot provide them again "
                f"({reason}). No key of this restore is visible. Put the dump back in place "
                f"and run tqtx.recover_data_load({plan.dump_dir!r}) to roll it forward, or "
                f"tqtx.recover_data_load({plan.dump_dir!r}, cancel=True) to end it as failed.",
                restore_id=rid, dump_dir=plan.dump_dir, reason="redo_failed", units=units,
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
                restore_id=rid, dump_dir=plan.dump_dir, reason="apply_pending", units=units,
                partition_id=plan.partition_id)
        part = self.meta.partition(plan.partition_id, create=True)
        for field, schema in plan.field_schema.items():
            part.schema[field] = merge_schema(part.schema.get(field), schema)
        for key, idx, fields, tag, is_new in plan.rows:
            if is_new:
                part.keys[key] = idx
                part.fields[idx] = set(fields)
                part.tags[key] = dict(tag or {})
            else:
                part.fields.setdefault(idx, set()).update(fields)
                if tag:
                    part.tags.setdefault(key, {}).update(tag)
        for idx in plan.new_indexes:
            self.meta.reserved.pop(idx, None)
        faults.hit("controller.restore.after_publish")
        self.restores.pop(rid, None)
        self.journal.finish_restore(rid, "committed", None)
        log.info("restore %s: committed (%d keys)", rid, len(plan.rows))

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

    # ---------------------------------------------------------------- checkpoint
    def _refuse_if_restoring(self, what: str) -> None:
        for plan in self.restores.values():
            raise self._pending_error(plan, what)

    def checkpoint_snapshot(self, body, req):
        self._refuse_if_restoring("save_checkpoint")
        return {"metadata": self.meta.snapshot(), "num_units": self.num_units}

    def checkpoint_replace(self, body, req):
        self._refuse_if_restoring("load_checkpoint")
        self.meta.replace(body["metadata"])
        return {"ok": True}

    def _keys_held(self) -> int:
        return sum(len(p.keys) for p in list(self.meta.partitions.values()))

    def stats(self, body, req):
        """GET_STATS (alias STATS): process facts, open restores and per-op request metrics."""
        keys = self._keys_held()
        open_restores = [{"restore_id": r["restore_id"], "partition_id": r["partition_id"],
                          "state": r["state"], "dump_dir": r["dump_dir"],
                          "units": {u["unit_id"]: u["state"] for u in r.get("units", [])}}
                         for r in self.journal.unresolved_restores()]
        m = self.server.metrics
        return {"role": "controller", "unit_id": None, "pid": os.getpid(),
                "uptime": time.time() - self.started, "address": self.address,
                "partitions": len(self.meta.partitions), "keys": keys, "rows": keys, "bytes": 0,
                "open_restores": open_restores, "incarnation": self.incarnation,
                "metrics_enabled": m.enabled, "ops": m.ops_snapshot(),
                "totals": m.totals_snapshot()}

    def serve_forever(self) -> None:
        try:
            self.server.serve_forever()
        finally:
            self.journal.end_incarnation(self.incarnation)
            self.journal.close()
            for p in self.unit_peers.values():
                p.close()
            self.lock.release()
