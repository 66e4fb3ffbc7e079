"""A COMMIT_PUT whose controller keeps going away is sent again, with its request ID, to
each controller that comes back, and never given up for a redo of the put from ALLOC: a
redo could write a key again that the lost commit had made visible, after writes made
since (the whole-job history checker found such a history: a checkpoint load between the
lost commit and the redo)."""
from __future__ import annotations

import pytest

from tqtx.client import put_path
from tqtx.errors import PeerDiedError


class _Controller:
    def __init__(self, losses: int):
        self.losses, self.rids = losses, []

    def call(self, op, body, rid=None, **kw):
        self.rids.append(rid)
        if len(self.rids) <= self.losses:
            raise PeerDiedError(f"controller gone ({op})")
        return {"fields": ["x"], "op": op}


class _Client:
    address = "tcp://127.0.0.1:1"

    def __init__(self, losses: int):
        self.controller = _Controller(losses)
        self.awaited = 0

    def await_controller(self, what, *, outcome=""):
        self.awaited += 1
        return {"incarnation": 100 + self.awaited}  # a new controller each time


@pytest.mark.parametrize("losses", [1, 2, 5, put_path.COMMIT_SENDS - 1])
def test_a_commit_is_sent_again_to_each_controller_that_comes_back(losses):
    client = _Client(losses)
    res = put_path._put_step(client, "COMMIT_PUT", {"keys": ["k"]}, 7, "putting 1 key(s)",
                             put_path._COMMIT_UNSURE)
    assert res == {"fields": ["x"], "op": "COMMIT_PUT"}
    assert len(client.controller.rids) == losses + 1 and client.awaited == losses
    assert len(set(client.controller.rids)) == 1  # one request ID: answered by the journal


def test_a_commit_whose_controller_never_stays_names_the_unknown_outcome():
    client = _Client(put_path.COMMIT_SENDS)
    with pytest.raises(PeerDiedError, match="went away 8 times while putting 1 key.*its "
                                            "commit may not have been applied"):
        put_path._put_step(client, "COMMIT_PUT", {"keys": ["k"]}, 7, "putting 1 key(s)",
                           put_path._COMMIT_UNSURE)
    assert len(client.controller.rids) == put_path.COMMIT_SENDS
    assert len(set(client.controller.rids)) == 1


def test_an_alloc_met_by_a_new_controller_is_redone_from_the_start():
    """ALLOC is different: nothing of the put is visible before its commit."""
    client = _Client(1)
    with pytest.raises(put_path._ControllerRestarted):
        put_path._put_step(client, "ALLOC", {"keys": ["k"]}, 7, "putting 1 key(s)", "none")
    same = _Client(1)
    same.await_controller = lambda what, outcome="": {"incarnation": 7}
    assert put_path._put_step(same, "ALLOC", {"keys": ["k"]}, 7, "putting", "none")["op"] \
        == "ALLOC"
    assert len(set(same.controller.rids)) == 1
