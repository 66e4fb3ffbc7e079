"""Closing after a controller restart ends the deployment as it would have without one
(issue 33, item 5).

The creator's ``tq.close()`` used to judge the controller by the process it had started: a
controller restarted by hand on the same state dir and port (``tqtx controller``) answered
END_BUFFER, but a reply taking over a second was given up on with "pid ... exited", the
buffer's metadata stayed in the journal and the next ``init`` listed every key again (and
the hand-started controller kept the state dir). END_BUFFER is made slow here with a fault
point so the reply always takes longer than that check.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tq_procs import alive, wait_gone
from tqtx import api

SLOW_END = {"TQTX_FAULTS": "controller.request.END_BUFFER:delay:1.5"}


def _fill(n: int = 50):
    keys = [f"k{i}" for i in range(n)]
    tq.kv_batch_put(keys, "p", TensorDict({"x": torch.ones(n, 3)}, batch_size=[n]))
    return keys


def _close_and_check(state_dir, caplog, pids) -> None:
    with caplog.at_level(logging.WARNING, logger="tqtx.init"):
        tq.close()
    said = [r.getMessage() for r in caplog.records if r.name == "tqtx.init"]
    assert not said, said
    assert wait_gone(pids) == [], "deployment processes still running"
    cfg = tq.init({"state_dir": state_dir})
    try:
        assert cfg["mode"] == "embedded"
        assert tq.kv_list() == {}  # the buffer ended with the deployment
    finally:
        tq.close()


@pytest.mark.slow  # quick tier: test_close_with_the_controller_dead_still_stops_the_units
def test_close_after_restart_controller_ends_the_buffer(tq_start, tmp_path, caplog):
    state = str(tmp_path / "state")
    tq_start(2, state_dir=state)
    _fill()
    dep = api._deployment_handle()
    dep.restart_controller(env=SLOW_END)
    assert len(tq.kv_list()["p"]) == 50
    _close_and_check(state, caplog, list(dep.pids.values()))


@pytest.mark.slow
def test_close_after_a_hand_restarted_controller_ends_the_buffer_and_stops_it(tq_start,
                                                                              tmp_path, caplog):
    state = str(tmp_path / "state")
    cfg = tq_start(2, state_dir=state)
    _fill()
    dep = api._deployment_handle()
    ours = dep.procs["controller"]
    ours.kill()
    ours.wait(10)
    port = cfg["address"].rsplit(":", 1)[1]
    hand = subprocess.Popen([sys.executable, "-m", "tqtx", "controller", "--units", "2",
                             "--state-dir", state, "--port", port],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, **SLOW_END})
    try:
        assert hand.stdout.readline().startswith(b"TQTX {\"ready\"")
        assert len(tq.kv_list()["p"]) == 50  # the units re-registered with it
        _close_and_check(state, caplog, [p for n, p in dep.pids.items() if n != "controller"])
        assert hand.wait(10) == 0  # close stopped it (SHUTDOWN), as it stops its own
    finally:
        if hand.poll() is None:
            hand.kill()
            hand.wait(5)
        hand.stdout.close()
    assert not alive(hand.pid)


def test_close_with_the_controller_dead_still_stops_the_units(tq_start, tmp_path, caplog):
    state = str(tmp_path / "state")
    tq_start(2, state_dir=state)
    _fill(3)
    dep = api._deployment_handle()
    dep.procs["controller"].kill()
    dep.procs["controller"].wait(10)
    with caplog.at_level(logging.WARNING, logger="tqtx.init"):
        tq.close()
    said = [r.getMessage() for r in caplog.records if r.name == "tqtx.init"]
    assert len(said) == 1 and "did not discard the buffer's metadata" in said[0], said
    assert wait_gone(list(dep.pids.values())) == []
