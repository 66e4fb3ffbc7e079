"""What a controller does at startup, before it serves: settle what an earlier one left.

1. The buffer's metadata is replayed from the journal (:class:`~tqtx.journal.meta.MetaJournal`).
2. Restores an earlier incarnation left open are settled (:func:`recover_controller_journal`):
   ``active`` ones end as ``aborted`` (their dump journal rows and publications settled first);
   ``committing`` ones with a stored plan are rebuilt, their new indexes reserved again, and
   rolled forward by the next FINISH_RESTORE (``recover_data_load``) once units re-register.
"""
from __future__ import annotations

import logging
import time

from filelock import Timeout as LockTimeout
from sqlalchemy.exc import SQLAlchemyError

from .. import states as st
from ..journal.publish import dump_lock, recover_publications
from ..errors import DumpFormatError
from ..durability import LOGGED
from ..journal.controller import ControllerJournal
from ..journal.dump import DumpJournal
from ..journal.meta import (CHECKPOINT_GEN_BASE, CHECKPOINT_KEYS, CHECKPOINT_LOAD,
                            CHECKPOINT_PLAN, ROW_LOG_UNITS, MetaChange)
from ..layout.paths import find_dump_journal
from ..plan import RestorePlan
from ..wire import codec
from .kv import CheckpointPlan

log = logging.getLogger("tqtx.controller")

# How long the replay waits for a dump's lock. A live client may hold it while it waits for
# this controller's answer (a restore or dump of that dump begun as the old controller
# died): waiting longer would have both wait until the client's request times out.
DUMP_LOCK_WAIT = 2.0


def replay(ctl) -> list[dict]:
    """Load controller ``ctl``'s metadata and open restores from its journal; returns the
    recovery actions taken (also journaled as recovery events)."""
    t0 = time.perf_counter()
    snap = ctl.metajournal.load()
    keys_blob = snap["blobs"].get(CHECKPOINT_KEYS)
    if keys_blob is None:
        ctl.meta.replace(snap)
    else:
        # a checkpoint load was decided, and its keys not yet written row by row (the
        # decision wiped every other key): they come from its metadata, then are written
        gen_base, packed = codec.unpackb(keys_blob)
        decided = codec.unpackb(packed)
        ctl.meta.replace(decided, gen_base)
        ctl.kv.checkpoint_keys = (decided, gen_base)
        ctl.kv.journal_checkpoint_keys()
        snap = {**snap, "partitions": decided["partitions"]}
    for rid, reply in snap.get("answered") or ():
        # a copy of a request the last incarnation acted on, resent because its reply was
        # lost with that process, gets the recorded reply (wire.rpc's reply cache)
        ctl.server.remember_reply(rid, codec.unpackb(reply))
    markers = snap.get("markers") or {}
    _check_row_log_units(ctl, markers, snap)
    if markers.get(CHECKPOINT_LOAD):
        ctl.kv.checkpoint_load = (markers[CHECKPOINT_LOAD], int(markers[CHECKPOINT_GEN_BASE]))
        plan = (snap.get("blobs") or {}).get(CHECKPOINT_PLAN)
        if plan is not None:
            ctl.kv.checkpoint_plan = CheckpointPlan(plan)
    keys = sum(len(p["rows"]) for p in snap["partitions"].values())
    if keys:
        log.warning("startup: replayed %d keys in %d partitions (%d lost rows) from the journal "
                    "in %.2fs; waiting for the units to re-register", keys,
                    len(snap["partitions"]), ctl.meta.lost_rows(), time.perf_counter() - t0)
    actions = recover_controller_journal(ctl.journal, incarnation_id=ctl.incarnation,
                                         keep_committing=ctl.metajournal.enabled)
    for rec in ctl.journal.unresolved_restores():
        data = ctl.journal.restore_plan(rec["restore_id"])
        if rec["state"] != st.COMMITTING or not data:
            continue
        ctl.restores.resume(RestorePlan.decode(data))
    for event in actions:
        log.warning("startup recovery: %s %s: %s %s", event.get("kind"), event.get("target"),
                    event.get("action"), event.get("detail", ""))
    return actions


def _check_row_log_units(ctl, markers: dict, snap: dict) -> None:
    """Refuse a unit count other than the one whose row logs hold the journaled buffer
    (every row is at its index's unit, ``index % units``: other units would report rows the
    metadata places elsewhere, and drop them); record this start's count when it logs."""
    logged = markers.get(ROW_LOG_UNITS)
    keys = any(p["rows"] for p in snap["partitions"].values())
    if logged is not None and keys and int(logged) != ctl.num_units:
        raise RuntimeError(
            f"{ctl.state_dir}: the buffer of this state dir was kept by {logged} units in "
            f"their row logs (durability buffer or sync); start with num_units={logged} to "
            f"recover it. To move it to {ctl.num_units} units, recover it with {logged}, "
            f"dump_data_by_key every key, close, start with {ctl.num_units} and "
            f"load_data_by_key the dump")
    want = str(ctl.num_units) if ctl.metajournal.durability in LOGGED else None
    if logged != want:
        ctl.metajournal.write(MetaChange(markers={ROW_LOG_UNITS: want}))


def recover_controller_journal(journal: ControllerJournal, *, incarnation_id: int,
                               keep_committing: bool = False) -> list[dict]:
    """Finish every restore a previous incarnation left non-final as ``aborted``, except,
    with ``keep_committing``, a ``committing`` one whose plan was stored with its decision:
    that one stays open (its dump journal row too) to be rolled forward.

    Non-final claims become ``dropped`` (done by ``finish_restore``). Before that, for each
    such restore whose dump journal exists (beside the dump, or in this controller's state dir
    for a read-only dump), the dump journal's restore row is marked
    ``aborted`` and the dump's unfinished publications are settled, under the dump lock
    (a failure there is recorded as ``dump-recovery-failed`` and does not stop the replay). Every action is
    journaled with ``record_recovery`` and returned as ``{kind, target, action, detail}``.
    A dump whose lock another process holds for more than :data:`DUMP_LOCK_WAIT` is left to
    that process and to the next reader or writer of the dump (``dump-journal-busy``): each
    settles a reader row from the controller's final state and recovers the publications
    under the lock. The restore is aborted all the same: it can never commit.
    Must not be called while holding a dump lock of one of these dumps.
    """
    actions: list[dict] = []

    def act(kind: str, target: str, action: str, detail: str) -> None:
        journal.record_recovery(incarnation_id=incarnation_id, kind=kind, target=target,
                                action=action, detail=detail)
        actions.append({"kind": kind, "target": target, "action": action, "detail": detail})

    dumps_done: set[str] = set()
    dumps_busy: set[str] = set()
    for r in journal.unresolved_restores():
        if r["incarnation_id"] == incarnation_id:
            continue
        rid, dump_dir = r["restore_id"], r["dump_dir"]
        if keep_committing and r["state"] == st.COMMITTING and journal.restore_plan(rid):
            act("restore", rid, "kept-committing",
                f"commit decided under incarnation {r['incarnation_id']}; rolled forward by "
                f"recover_data_load({dump_dir!r})")
            continue
        # The dump side goes first: if we crash in between, the controller row is still
        # non-final and the next replay redoes both sides (each is idempotent).
        try:
            dj_path = find_dump_journal(dump_dir, journal.state_dir)
        except OSError as exc:
            dj_path = None
            act("restore", rid, "dump-recovery-failed", f"dump {dump_dir}: {exc!r}")
        busy = (f"dump {dump_dir}: its lock is held by another process (a client of it); "
                f"that process or the dump's next reader settles its journal")
        if dj_path is not None and dump_dir in dumps_busy:
            act("restore", rid, "dump-journal-busy", busy)
        elif dj_path is not None:
            try:
                with dump_lock(dump_dir, DUMP_LOCK_WAIT, state_dir=journal.state_dir), \
                        DumpJournal(dump_dir, path=dj_path) as dj:
                    row = dj.get_restore(rid)
                    if row is not None and row["state"] == st.READING:
                        dj.finish_restore(rid, st.ABORTED)
                        act("restore", rid, "dump-journal-aborted", f"dump {dump_dir}")
                    if dump_dir not in dumps_done:
                        dumps_done.add(dump_dir)
                        for a in recover_publications(dump_dir, dj):
                            act(a["kind"], a["target"], a["action"], a["detail"])
            except LockTimeout:
                dumps_busy.add(dump_dir)
                act("restore", rid, "dump-journal-busy", busy)
            except (OSError, SQLAlchemyError, DumpFormatError) as exc:
                # An unreachable dump (unmounted, permissions) must not stop the controller
                # from starting; the dump is recovered by the next writer or by hand.
                act("restore", rid, "dump-recovery-failed", f"dump {dump_dir}: {exc!r}")
        live_units = [u["unit_id"] for u in r["units"] if u["state"] not in st.UNIT_FINAL]
        journal.abort_after_restart(rid)
        act("restore", rid, st.ABORTED,
            f"was {r['state']} under incarnation {r['incarnation_id']}; "
            f"dropped units: {','.join(map(str, live_units)) or 'none'}")
    return actions
