"""The controller process: metadata, restore decisions and the controller journal.

One ROUTER socket, one thread. It never touches payload bytes: units hold them. The
controller owns its roles -- KV requests (:mod:`tqtx.controller.kv`), restores
(:mod:`tqtx.controller.restores`), TransferQueue's low-level client requests
(:mod:`tqtx.controller.dataplane`) -- and registers their handlers; units, their
registration and the process's facts are here.
"""
from __future__ import annotations

import gc
import logging
import os
import socket
import time

from .. import durability as dur
from .. import faults
from .. import states as st
from ..errors import ControllerRecoveringError, StateDirInUseError
from ..journal.controller import ControllerJournal
from ..journal.meta import MetaJournal
from ..layout.paths import controller_lock_path, controller_owner_path
from ..version import __version__
from ..wire.peer import CONNECT_TIMEOUT, Peer
from ..wire.rpc import Server
from .dataplane import DataPlaneRequests
from .group_commit import GroupCommit
from .kv import KVRequests
from .lost import DeadBufferCheck
from .metadata import Metadata
from .restores import RestoreCoordinator
from .startup import replay
from .units import UnitPeers

log = logging.getLogger("tqtx.controller")

UNIT_WAIT = float(os.environ.get("TQTX_UNIT_WAIT", "60"))
_EMPTY_HELD = {"indexes": [], "field_sets": [], "fields_of": []}


def restore_unit_label(body) -> str:
    """Metrics label of a RESTORE_UNIT request: one per action."""
    action = body.get("action") if isinstance(body, dict) else None
    return f"RESTORE_UNIT:{action if action in st.RESTORE_UNIT_ACTIONS else 'other'}"


def acquire_state_dir(state_dir: str):
    """Take exclusive ownership of ``state_dir`` or raise StateDirInUseError."""
    import filelock

    os.makedirs(state_dir, exist_ok=True)
    # not thread-local: an in-process controller is made on one thread and served (and
    # stopped, releasing the lock) on another
    lock = filelock.FileLock(os.fspath(controller_lock_path(state_dir)), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        owner = ""
        try:
            with open(controller_owner_path(state_dir)) as f:
                owner = f.read().strip()
        except OSError:
            pass
        raise StateDirInUseError(
            f"state dir {state_dir} is in use by another running controller ({owner or 'unknown'}); "
            f"stop it or choose another state_dir") from None
    return lock


class Controller:
    """The controller: process, units and stats here; it owns ``kv``
    (:class:`~tqtx.controller.kv.KVRequests`), ``restores``
    (:class:`~tqtx.controller.restores.RestoreCoordinator`) and ``dataplane``
    (:class:`~tqtx.controller.dataplane.DataPlaneRequests`); startup replay in
    :mod:`tqtx.controller.startup`.

    ``durability`` (``"memory"``, ``"controller"``, ``"buffer"``, ``"sync"``; see
    :mod:`tqtx.durability`) and ``flush_interval_s``: how metadata changes are journaled
    (see :class:`~tqtx.journal.meta.MetaJournal`); with ``"buffer"`` the loop makes a
    durable cut at most every ``flush_interval_s`` when something was committed."""

    def __init__(self, *, num_units: int, state_dir: str, host: str = "127.0.0.1", port: int = 0,
                 curve=None, client_curve=None, durability: str = dur.DEFAULT,
                 flush_interval_s: float = dur.FLUSH_INTERVAL_S):
        durability = dur.check(durability)
        flush_interval_s = dur.check_interval(flush_interval_s)
        self.num_units = num_units
        self.state_dir = os.path.abspath(state_dir)
        self.lock = acquire_state_dir(self.state_dir)
        self.server = Server("controller", host, port, curve=curve)
        self.address = self.server.address
        self.client_curve = client_curve
        with open(controller_owner_path(self.state_dir), "w") as f:
            f.write(f"pid {os.getpid()} on {socket.gethostname()} at {self.address}")
        self.journal = ControllerJournal(self.state_dir)
        self.incarnation = self.journal.start_incarnation(
            pid=os.getpid(), host=socket.gethostname(), address=self.address, version=__version__)
        self.meta = Metadata(self.incarnation)
        self.metajournal = MetaJournal(self.journal.engine, durability, flush_interval_s)
        if self.metajournal.cuts_wanted:
            self.server.turn_hooks.append(self._durable_cut)
        # "sync": the requests of a loop turn share one fsync of what they journaled, and
        # none is answered before it
        self.group_commit = (GroupCommit(self.server, self.metajournal)
                             if self.metajournal.group_commits else None)
        self.unit_peers = UnitPeers()
        self.restores = RestoreCoordinator(
            meta=self.meta, journal=self.journal, units=self.unit_peers, num_units=num_units,
            incarnation=self.incarnation, store_plans=self.metajournal.enabled,
            require_units=self._require_units, topology=self._topology,
            defer=self.server.call_soon,
            # with sync a unit answers once the applied rows are fsynced
            apply_timeout=60.0 if durability == dur.SYNC else 10.0)
        self.kv = KVRequests(
            meta=self.meta, journal=self.journal, metajournal=self.metajournal,
            units=self.unit_peers, num_units=num_units, incarnation=self.incarnation,
            restores=self.restores, require_units=self._require_units, topology=self._topology,
            after_reply=self.server.after_reply)
        self.restores.before_publish = self.kv.journal_checkpoint_keys
        self.dataplane = DataPlaneRequests(meta=self.meta, kv=self.kv)
        self.recovered = replay(self)
        # After replaying a buffer, new rows wait until every unit has re-registered (and
        # reported what it holds), or UNIT_WAIT seconds: see _require_units.
        self.awaiting_units = (set(range(num_units)) if self.meta.partitions or
                               self.kv.checkpoint_load else set())
        self.dead_buffer = DeadBufferCheck(self)  # a whole-job crash: start empty
        self.unit_wait_until = time.monotonic() + UNIT_WAIT
        self.units: dict[int, str] = {}
        # Topology incarnation: changes whenever a unit (re-)registers at a new address;
        # replies that lead a client to units carry it ("topology"). The controller
        # incarnation in the high bits keeps it distinct across controller restarts.
        self.topology_incarnation = self.incarnation << 32
        self.started = time.time()
        self.counters: dict[str, int] = {}
        s, kv, rs, dp = self.server, self.kv, self.restores, self.dataplane
        for op, fn, mutating in [
            ("PING", self.ping, False), ("REGISTER_UNIT", self.register_unit, True),
            ("TOPOLOGY", self.topology, False), ("ALLOC", kv.alloc, True),
            ("COMMIT_PUT", kv.commit_put, True), ("ABORT_PUT", kv.abort_put, True),
            ("LOOKUP", kv.lookup, False),
            ("LIST", kv.list_keys, False), ("CLEAR", dp.clear_forgetting, True),
            ("DESCRIBE_ROWS_BY_KEY", kv.describe_rows, False),
            ("TAKE_DUMP_TAGS", kv.take_dump_tags, True),
            ("RECORD_DUMP", kv.record_dump, True),
            ("VALIDATE_DUMP_SCHEMA", rs.validate_dump_schema, False),
            ("BEGIN_RESTORE", rs.begin_restore, True), ("RESTORE_UNIT", rs.restore_unit, True),
            ("FINISH_RESTORE", rs.finish_restore, True), ("LIST_RESTORES", rs.list_restores, False),
            ("GET_RESTORE", rs.get_restore, False),
            ("CHECKPOINT_SNAPSHOT", kv.checkpoint_snapshot, False),
            ("CHECKPOINT_CHECK", kv.checkpoint_check, False),
            ("CHECKPOINT_REPLACE", dp.replace_forgetting, True),
            ("STATS", self.stats, False), ("GET_STATS", self.stats, False),
            ("END_BUFFER", dp.end_forgetting, True), ("SHUTDOWN", self.shutdown, True),
            ("KV_META", dp.kv_meta, False), ("KV_KEYS", dp.kv_keys, False),
            ("STREAM_META", dp.stream_meta, True), ("CONSUMPTION", dp.consumption, False),
            ("PRODUCTION", dp.production, False),
            ("RESET_CONSUMPTION", dp.reset_consumption, True),
            ("PARTITIONS", dp.partitions, False),
            ("DATAPLANE_OPTIONS", dp.dataplane_options, True),
        ]:
            if self.group_commit is not None:  # reads too: they may see undurable changes
                fn = self.group_commit.wrap(fn)
            s.add(op, fn, mutating=mutating)
        # restore claims are counted per action: RESTORE_UNIT:claim / :staged / :failed
        s.op_labels["RESTORE_UNIT"] = restore_unit_label
        s.metrics.gauge("rows_held", self._keys_held)
        s.metrics.gauge("bytes_held", lambda: 0)
        s.metrics.gauge("open_restores", lambda: len(self.restores))

    # ---------------------------------------------------------------- basics
    def _topology(self) -> int:
        return self.topology_incarnation

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
        held = body.get("held")
        stale = False  # the unit holds rows from before a checkpoint it never switched to
        if self.kv.checkpoint_load:
            load_id = self.kv.checkpoint_load[0]
            ck = body.get("checkpoint") or {}
            if ck.get("applied") != load_id:
                if load_id in (ck.get("staged") or ()):
                    return self._switch_first(uid)
                cp = self.kv.checkpoint_plan
                plan = cp.for_unit(uid) if cp is not None else None
                if plan is not None and ck.get("failed") != load_id:
                    return self._switch_first(uid, stage=plan)
                stale = True
        t0 = time.perf_counter()
        drop, lost = self._reconcile(uid, _EMPTY_HELD if stale else held)
        reconciled = time.perf_counter() - t0
        if stale and held:
            drop = [[i, g] for i, g in zip(held.get("indexes") or (), held.get("gens") or ())]
        # the units of a buffer kept in row logs say what came back, or that nothing did
        if body.get("replayed") or (lost and self.metajournal.durability in dur.LOGGED):
            self._note_replay(uid, body.get("replayed"), len((held or {}).get("indexes") or ()),
                              len(drop), lost, reconciled)
        self.dead_buffer.unit_reported(uid, held, body.get("attached", True))
        self.awaiting_units.discard(uid)
        if not self.awaiting_units:
            self.dead_buffer.settle(self)
        if self.kv.checkpoint_load and not self.awaiting_units:
            self.kv.checkpoint_switched()
        drop_staged = [rid for rid in body.get("staged") or () if rid not in self.restores]
        log.info("unit %d registered at %s (topology %d)%s", uid, body["address"],
                 self.topology_incarnation & 0xFFFFFFFF,
                 f": {lost} rows lost, {len(drop)} unknown rows to drop, "
                 f"{len(drop_staged)} stale restores" if lost or drop or drop_staged else "")
        faults.hit("controller.meta.unit_lost.before_reply")
        return {"incarnation": self.incarnation, "drop": drop, "drop_staged": drop_staged}

    def _note_replay(self, uid: int, replayed: dict | None, rows: int, dropped: int,
                     lost: int, reconciled: float) -> None:
        """Journal what unit ``uid`` brought back from its row log, or that it came back
        without rows the metadata names (``tqtx journal show``)."""
        action = st.REPLAYED
        if replayed is None:  # no log to replay: a new data dir (its node or disk lost), or
            replayed = {}     # a unit that restarted without one
            action, source = st.ROWS_LOST, "no row log replayed"
        else:
            source = (f"{rows} rows from {replayed.get('entries')} log entries "
                      f"({replayed.get('bytes')} bytes, "
                      f"{float(replayed.get('seconds', 0)):.3f}s) in {replayed.get('dir')}")
        detail = (f"{source}; {dropped} dropped (no committed put names "
                  f"them), {lost} rows of committed keys missing (named lost), "
                  f"{len(replayed.get('torn') or ())} torn file ends cut off; reconciled in "
                  f"{reconciled:.3f}s")
        self.journal.record_recovery(incarnation_id=self.incarnation, kind="buffer",
                                     target=f"unit {uid}", action=action,
                                     detail=detail[:2000])
        log.warning("unit %d: %s", uid, detail)

    def _switch_first(self, uid: int, stage: dict | None = None) -> dict:
        """The reply to a unit registering while a checkpoint switch is open (the controller
        restarted after deciding it, or the unit missed the switch) that has not switched:
        switch, then report again. A unit that holds the load neither staged nor applied (it
        restarted) first reads its rows again by the decision's plan (``stage``, its
        LOAD_CHECKPOINT body). Without a plan, or if that read failed, it is reconciled as
        empty, and the rows it still holds, from before the checkpoint, are dropped
        (register_unit)."""
        load_id, gen_base = self.kv.checkpoint_load
        log.info("unit %d: switching to checkpoint load %s before it reports%s", uid, load_id,
                 " (reading its rows again first)" if stage is not None else "")
        reply = {"incarnation": self.incarnation, "drop": [], "drop_staged": [],
                 "apply_checkpoint": load_id, "gen_base": gen_base}
        if stage is not None:
            reply["stage_checkpoint"] = stage
        return reply

    def _require_units(self, what: str) -> None:
        """ControllerRecoveringError while a replayed buffer waits for units to re-register.

        A unit reports the rows it holds from a snapshot; a put committed between that
        snapshot and this controller reading the report would be taken for a lost row, so
        no new rows are handed out until every unit has reported (at most UNIT_WAIT s)."""
        if not self._awaiting():
            return
        raise ControllerRecoveringError(
            f"{what}: the controller restarted and waits for units "
            f"{sorted(self.awaiting_units)} to re-register (at most {UNIT_WAIT:.0f}s); retry")

    def _awaiting(self) -> bool:
        """Whether units of a replayed buffer are still to re-register (bounded)."""
        if not self.awaiting_units:
            return False
        if time.monotonic() > self.unit_wait_until:
            log.error("units %s did not re-register within %ss of the controller's start; "
                      "serving without them", sorted(self.awaiting_units), UNIT_WAIT)
            self.awaiting_units.clear()
            return False
        return True

    def _reconcile(self, uid: int, held) -> tuple[list[list[int]], int]:
        """Compare what unit ``uid`` holds with the metadata: rows it should hold (at their
        generation) and does not become lost (journaled); rows of a generation no key,
        pending put or restore accounts for are returned (``[index, generation]``) for the
        unit to drop. A unit that reports nothing (``held`` None) is left alone."""
        if held is None:
            return [], 0
        sets = [frozenset(f) for f in held.get("field_sets") or ()]
        indexes, gens = held.get("indexes") or (), held.get("gens") or ()
        have = dict(zip(indexes, zip(gens, (sets[i] for i in held.get("fields_of") or ()))))
        change = self.meta.plan_lost(uid, self.num_units, have)
        if change:
            self.kv.journal_meta("unit_lost", change)
            self.meta.apply_lost(change)
            if not have and not self.dead_buffer.done:
                log.warning("unit %d came back empty: %d rows of the replayed buffer are "
                            "marked lost (if no unit kept any row, the buffer is dropped "
                            "once all units registered)", uid, len(change.rows))
            else:
                log.error("unit %d came back without %d rows it held; they are marked lost "
                          "(RowsLostError on read; kv_list leaves them out, "
                          "tq.list_lost_keys names them)", uid, len(change.rows))
        known = self.meta.gens  # every allocated index: visible, pending, reserved
        return [[i, g] for i, g in zip(indexes, gens) if known.get(i) != g], len(change.rows)

    def topology(self, body, req):
        ready = len(self.units) == self.num_units and not self._awaiting()
        return {"ready": ready, "num_units": self.num_units,
                "units": [self.units.get(i) for i in range(self.num_units)],
                "incarnation": self.incarnation, "state_dir": self.state_dir,
                "topology": self.topology_incarnation,
                "version": __version__, "address": self.address,
                "metrics_endpoint": getattr(self, "metrics_endpoint", None)}

    def shutdown(self, body, req):
        self.server.stop()
        return {"ok": True}

    def _durable_cut(self) -> None:
        """Durability ``"buffer"``: make what was committed durable once the interval is up
        (run by the loop after each turn, so on the journal connection's thread)."""
        if self.metajournal.cut_due():
            self.metajournal.cut()

    def _keys_held(self) -> int:
        return sum(len(p.keys) for p in list(self.meta.partitions.values()))

    def stats(self, body, req):
        """GET_STATS (alias STATS): process facts, open restores and per-op request metrics."""
        keys = self._keys_held()
        open_restores = [{"restore_id": r["restore_id"], "partition_id": r["partition_id"],
                          "state": r["state"], "dump_dir": r["dump_dir"],
                          "units": st.unit_states(r)}
                         for r in self.journal.unresolved_restores()]
        m = self.server.metrics
        return {"role": "controller", "unit_id": None, "pid": os.getpid(),
                "uptime": time.time() - self.started, "address": self.address,
                "partitions": len(self.meta.visible()), "keys": keys, "rows": keys, "bytes": 0,
                "lost_rows": self.meta.lost_rows(), "durability": self.metajournal.durability,
                "flush_interval_s": self.metajournal.flush_interval_s,
                "durable_cuts": self.metajournal.cuts,
                "open_restores": open_restores, "incarnation": self.incarnation,
                "gc_frozen": gc.get_freeze_count(),
                "metrics_enabled": m.enabled, "ops": m.ops_snapshot(),
                "totals": m.totals_snapshot()}

    def serve_forever(self) -> None:
        # "buffer": the loop wakes at least once per flush interval to make its cut
        poll_ms = (max(1, min(200, int(self.metajournal.flush_interval_s * 1000)))
                   if self.metajournal.cuts_wanted else 200)
        try:
            self.server.serve_forever(poll_ms)
            if self.metajournal.cuts_wanted or self.metajournal.group_commits:
                try:  # a clean stop leaves nothing it committed undurable
                    if self.metajournal.cut():
                        log.info("stopping: the metadata journal's last commits made "
                                 "durable (cut %d)", self.metajournal.cuts)
                except Exception:
                    log.exception("the last durable cut of the metadata journal failed")
        finally:
            self.journal.end_incarnation(self.incarnation)
            self.metajournal.close()
            self.journal.close()
            for p in self.unit_peers.values():
                p.close()
            self.lock.release()
