"""Crash matrix, row log part: a unit of a ``sync`` deployment is killed (or its step raises)
at every point of its row log (crash_table.ROWLOG), or the controller of a ``buffer``
deployment at its durable cut, then the whole job is SIGKILLed and started again on the
same state dir. Every put acknowledged before the fault is back bit for
bit, every acknowledged clear stays cleared, and the keys of the operation in flight hold
their own value or are absent. Real processes, loopback only.

Also a whole-job crash in the middle of a ``load_checkpoint`` switch: after the controller
journaled the decision, before or after the units switched. The load is rolled forward: a
unit that had switched knows it from its row log (it is not switched again over later
writes), one that had not reads the checkpoint's rows again by the plan the decision
journaled; nothing is named lost.

Small segments and compaction thresholds (``TQTX_ROWLOG_SEGMENT_BYTES``,
``TQTX_ROWLOG_COMPACT_SLACK``) make the seal and compaction points come early. One case
runs in the quick tier, the rest in the slow tier."""
from __future__ import annotations

import os
import time

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from crash_table import ACKED_KEPT, ROWLOG
from tqtx import api
from whole_job import kill_whole_job, wait_units_registered

pytestmark = pytest.mark.timeout(300)

PID = "p"
ROUNDS = 12       # rounds at full speed; then paced, until the fault fired
MAX_ROUNDS = 60
FAST = {("unit.rowlog.after_append", "kill")}
# the hit of the point that fires: late enough for puts to be acknowledged before it
NTH = {"unit.rowlog.before_append": 3, "unit.rowlog.after_append": 3,
       "unit.rowlog.before_fsync": 3,
       # the first cut is the start's own commit, before the units registered
       "controller.meta.durable_cut.before_fsync": 3}


def _cases():
    for point, actions in ROWLOG.items():
        for action, outcome in actions.items():
            marks = [] if (point, action) in FAST else [pytest.mark.slow]
            yield pytest.param(point, action, outcome, id=f"{point}:{action}", marks=marks)


def _rows(keys, seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    return TensorDict({"x": torch.randint(0, 1 << 30, (len(keys), 1024), generator=gen)},
                      batch_size=[len(keys)])


def _log(state: str, name: str) -> str:
    with open(os.path.join(state, "logs", f"{name}.log")) as f:
        return f.read()


@pytest.mark.parametrize("point, action, outcome", list(_cases()))
def test_rowlog_crash(tq_start, tmp_path, point, action, outcome):
    assert outcome == ACKED_KEPT
    state = str(tmp_path / "state")
    fault = {"TQTX_FAULTS": f"{point}@{NTH.get(point, 1)}:{action}"}
    small = {"TQTX_ROWLOG_SEGMENT_BYTES": str(64 << 10),
             "TQTX_ROWLOG_COMPACT_SLACK": str(96 << 10)}
    if point.startswith("controller."):  # the controller's cut: durability buffer
        durability, where = "buffer", {"env": fault}
    else:
        durability, where = "sync", {"unit_env": {0: {**fault, **small}}}
    tq_start(2, state_dir=state, durability=durability, flush_interval_s=0.2, timeout=10,
             **where)
    faulty = api._deployment.procs["controller" if point.startswith("controller.")
                                   else "unit 0"]
    name = "controller" if point.startswith("controller.") else "unit-0"

    def fired() -> bool:
        if action == "kill":
            return faulty.poll() is not None
        return bool(failures) or "InjectedFault" in _log(state, name)

    acked: dict[str, list] = {}      # key -> its value, put and not cleared, both acknowledged
    in_flight: dict[str, list] = {}  # keys of a failed operation: their value or absent
    failures = 0
    prev: list[str] = []
    # rounds of puts and clears until the fault fired (the controller's cut comes once an
    # interval, so rounds are paced there), at most MAX_ROUNDS
    for rnd in range(MAX_ROUNDS):
        keys = [f"r{rnd}k{i}" for i in range(8)]
        td = _rows(keys, rnd)
        values = {k: td["x"][i].tolist() for i, k in enumerate(keys)}
        try:
            tq.kv_batch_put(keys, PID, td)
            acked.update(values)
        except Exception:  # noqa: BLE001 - the fault's error: the put may or may not be done
            failures += 1
            in_flight.update(values)
            break
        if prev:  # dead bytes in the log, so that a compaction comes; two keys stay
            try:
                tq.kv_clear(prev, PID)
                for k in prev:
                    acked.pop(k, None)
            except Exception:  # noqa: BLE001 - cleared or not
                failures += 1
                in_flight.update({k: acked.pop(k) for k in prev})
                break
        prev = keys[2:]
        if fired():
            break
        if name == "controller" or rnd >= ROUNDS:
            time.sleep(0.1)
    time.sleep(0.6)  # a background compaction or cut reaches its point; the writers catch up
    if action == "kill":
        assert faulty.wait(timeout=10) is not None, f"{name} did not die at {point}"
    else:
        assert fired(), f"{point} did not fire"
    assert acked, "no put was acknowledged before the fault"
    kill_whole_job()

    tq_start(2, state_dir=state, durability=durability, timeout=10)
    wait_units_registered()
    listed = set(tq.kv_list().get(PID, {}))
    lost = set(tq.list_lost_keys().get(PID, {}))
    assert set(acked) <= listed, f"acknowledged keys missing: {sorted(set(acked) - listed)}"
    assert listed <= set(acked) | set(in_flight), "keys back that were cleared or never put"
    assert lost <= set(in_flight)
    readable = sorted(listed - lost)
    got = tq.kv_batch_get(readable, PID)["x"] if readable else []
    for k, row in zip(readable, got):
        want = acked.get(k, in_flight.get(k))
        assert row.tolist() == want, f"key {k} reads another value"


@pytest.mark.parametrize("point", [
    # the decision is journaled; no unit switched (their staged rows die with them)
    "controller.meta.checkpoint_replace.after_commit@1",
    # every unit switched (rows and mark fsynced); the marker was not removed
    "controller.meta.checkpoint_replace.before_commit@2",
])
def test_a_whole_job_crash_during_a_checkpoint_switch_rolls_it_forward(tq_start, tmp_path,
                                                                      point):
    state, ckpt = str(tmp_path / "state"), str(tmp_path / "ckpt")
    tq_start(2, state_dir=state, durability="sync", timeout=10,
             env={"TQTX_FAULTS": f"{point}:kill"})
    saved = [f"s{i}" for i in range(12)]
    td = _rows(saved, 1)
    tq.kv_batch_put(saved, PID, td)
    want = {k: td["x"][i].tolist() for i, k in enumerate(saved)}
    tq.save_checkpoint(ckpt)
    later = [f"l{i}" for i in range(6)]
    tq.kv_batch_put(later, PID, _rows(later, 2))
    tq.kv_batch_put(saved[:3], PID, _rows(saved[:3], 3))  # overwritten after the save
    with pytest.raises(ConnectionError):  # the controller dies under the call
        tq.load_checkpoint(ckpt)
    assert api._deployment.procs["controller"].wait(timeout=10) is not None
    kill_whole_job()

    tq_start(2, state_dir=state, durability="sync", timeout=10)
    wait_units_registered()
    assert set(tq.kv_list().get(PID, {})) == set(saved)
    assert not tq.list_lost_keys().get(PID)
    got = tq.kv_batch_get(saved, PID)["x"]
    assert {k: got[i].tolist() for i, k in enumerate(saved)} == want
    tq.kv_batch_put(later, PID, _rows(later, 4))  # the buffer takes new keys again
    assert set(tq.kv_list()[PID]) == set(saved) | set(later)
