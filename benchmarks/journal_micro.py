"""The journal's share of a dump and of a restore, timed through the journals' public API.

Each function replays, on a fresh journal in ``state_dir``, the journal transactions one
dump and one restore make (see tqtx/dump/save.py, load.py, tqtx/journal/publish.py and
tqtx/controller), so the commits and fsyncs hit the same file system as the benchmark's
dumps. Medians of ``reps`` runs.
"""
from __future__ import annotations

import os
import time
import uuid

from _common import median


def dump_journal_micro(state_dir: str, reps: int = 5) -> dict:
    """Time the client's dump-journal calls of one dump (fresh target) and one restore."""
    from tqtx import states as st
    from tqtx.journal.dump import DumpJournal
    from tqtx.layout.paths import staging_path
    dump_t, restore_t = [], []
    for rep in range(reps):
        dump_dir = os.path.join(state_dir, f"dump-{rep}")
        aid, rid = uuid.uuid4().hex[:12], uuid.uuid4().hex
        t0 = time.perf_counter()
        with DumpJournal(dump_dir) as j:  # dump: check for readers, then publish
            j.active_restores()
            j.begin_publication(attempt_id=aid, kind="dump", dump_id="d",
                                staging_dir=staging_path(dump_dir, aid))
            for phase in (st.WRITTEN, st.SYNCED, st.PUBLISHED, st.CLEANED):
                j.set_phase(aid, phase)
        dump_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with DumpJournal(dump_dir) as j:  # restore: recover publications first
            j.unfinished_publications()
        with DumpJournal(dump_dir) as j:
            j.active_restores()
            j.begin_restore(restore_id=rid, controller_address="tcp://bench:0",
                            incarnation_id=1, controller_state_dir=state_dir, partition_id="p")
        with DumpJournal(dump_dir) as j:  # after the controller's commit
            j.get_restore(rid)
            j.finish_restore(rid, st.COMMITTED)
        restore_t.append(time.perf_counter() - t0)
    return {"dump_seconds": median(dump_t), "restore_seconds": median(restore_t)}


def controller_journal_micro(state_dir: str, units: int, reps: int = 5) -> dict:
    """Time the controller-journal transitions of one dump and one restore."""
    from tqtx import states as st
    from tqtx.journal.controller import ControllerJournal
    from tqtx.wire.rpc import new_id
    dump_t, restore_t = [], []
    with ControllerJournal(state_dir) as cj:
        inc = cj.start_incarnation(pid=os.getpid(), host="bench", address="tcp://bench:0",
                                   version="bench")
        for _ in range(reps):
            t0 = time.perf_counter()
            cj.record_dump(dump_id=new_id(), dump_dir="/bench/dump", partition_id="p",
                           keys=10_000, rows_with_data=10_000, bytes=1, shards=units,
                           incarnation_id=inc)
            dump_t.append(time.perf_counter() - t0)
            rid = new_id()
            t0 = time.perf_counter()
            cj.begin_restore(restore_id=rid, partition_id="p", dump_dir="/bench/dump",
                             dump_id="d", incarnation_id=inc, units=list(range(units)),
                             keys=10_000, rows=10_000, bytes=1)
            for u in range(units):
                cj.claim_unit(rid, u)
            for u in range(units):
                cj.stage_unit(rid, u, rows=10_000 // units, bytes=1)
            cj.decide_commit(rid)
            for u in range(units):
                cj.apply_unit(rid, u)
            cj.finish_restore(rid, st.COMMITTED, None)
            restore_t.append(time.perf_counter() - t0)
    return {"dump_seconds": median(dump_t), "restore_seconds": median(restore_t),
            "dump_transitions": 1, "restore_transitions": 3 + 3 * units}
