"""Fault-point spec parsing: a point listed twice runs its actions in order."""
from __future__ import annotations

import pytest

from tqtx import faults


@pytest.fixture(autouse=True)
def _reset():
    faults.configure("")
    yield
    faults.configure("")


def test_a_point_listed_twice_runs_its_actions_in_order():
    # the first action that raises ends the hit, so the order shows in what is raised
    faults.configure("p:delay:0,p:drop-reply,p:raise")
    with pytest.raises(faults.DropReply):
        faults.hit("p")
    faults.configure("p:delay:0,p:raise,p:drop-reply")
    with pytest.raises(faults.InjectedFault, match="fault injected at p"):
        faults.hit("p")


def test_each_action_keeps_its_own_hit_number():
    faults.configure("p@1:delay:0,p@2:raise")
    faults.hit("p")          # 1st hit: only the delay
    with pytest.raises(faults.InjectedFault):
        faults.hit("p")      # 2nd hit: the raise
    faults.hit("p")          # 3rd: nothing
    faults.hit("other")
