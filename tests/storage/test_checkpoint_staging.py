"""A unit keeps at most STAGED_LOADS checkpoint loads staged; a further one is refused
while they are fresh (dropping one a load_checkpoint is about to switch to would leave the
controller's decision without rows), and a stale one (its client died) makes room."""
from __future__ import annotations

import types

import pytest

from tqtx import states as st
from tqtx.errors import CheckpointBusyError
from tqtx.storage import checkpoints
from tqtx.storage.checkpoints import StagedLoad, UnitCheckpoints


def _unit_checkpoints() -> UnitCheckpoints:
    return UnitCheckpoints(types.SimpleNamespace(unit_id=3))


def test_a_load_beyond_the_fresh_staged_ones_is_refused_and_changes_nothing():
    cp = _unit_checkpoints()
    for i in range(checkpoints.STAGED_LOADS):
        cp._stage(StagedLoad(f"l{i}"))
    extra = StagedLoad("late")
    with pytest.raises(CheckpointBusyError, match="unit 3 holds 2 checkpoint loads staged"):
        cp._stage(extra)
    assert extra.state == st.FAILED
    assert list(cp.staged) == [f"l{i}" for i in range(checkpoints.STAGED_LOADS)]
    assert all(load.state == st.STAGED for load in cp.staged.values())


def test_a_stale_staged_load_makes_room_and_a_restaged_id_replaces_itself(monkeypatch):
    cp = _unit_checkpoints()
    cp._stage(StagedLoad("dead"))
    cp._stage(StagedLoad("live"))
    cp.staged["dead"].staged_at -= checkpoints.STALE_AFTER + 1
    dead = cp.staged["dead"]
    cp._stage(StagedLoad("new"))
    assert list(cp.staged) == ["live", "new"] and dead.state == st.DROPPED
    cp._stage(StagedLoad("live"))  # the same load staged again: no room needed
    assert list(cp.staged) == ["new", "live"]
