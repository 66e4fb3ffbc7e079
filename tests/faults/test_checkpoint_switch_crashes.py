"""A whole-job crash in the middle of a ``load_checkpoint`` switch (durability ``sync``):
after the controller journaled the decision, before or after the units switched, every
process is SIGKILLed and the job started again on the same state dir. The load is rolled
forward: the checkpoint's keys read the checkpoint's values, the keys put after the save
are gone, and nothing is named lost. A unit that had switched knows it from its row log (it
is not switched again over later writes); a unit that had not reads the checkpoint's rows
again by the plan the decision journaled. Real processes, loopback only."""
from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import api

pytestmark = pytest.mark.timeout(240)

PID = "p"


def _rows(keys, seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    return TensorDict({"x": torch.randint(0, 1 << 30, (len(keys), 256), generator=gen)},
                      batch_size=[len(keys)])


def _kill_everything() -> None:
    api._deployment.stop(graceful=False)
    api._client.close()
    api._client = api._deployment = api._config = None


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
    assert api._deployment.procs["controller"].poll() is not None
    _kill_everything()

    tq_start(2, state_dir=state, durability="sync", timeout=10)
    client = tq.get_client()
    deadline = time.monotonic() + 60
    while not client.controller.call("TOPOLOGY")["ready"]:
        assert time.monotonic() < deadline, "the units did not re-register"
        time.sleep(0.1)
    assert set(tq.kv_list().get(PID, {})) == set(saved)
    assert not tq.list_lost_keys().get(PID)
    got = tq.kv_batch_get(saved, PID)["x"]
    assert {k: got[i].tolist() for i, k in enumerate(saved)} == want
    tq.kv_batch_put(later, PID, _rows(later, 4))  # the buffer takes new keys again
    assert set(tq.kv_list()[PID]) == set(saved) | set(later)
