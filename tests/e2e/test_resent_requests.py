"""A request resent to a restarted controller is answered, not applied twice.

A client whose controller died before replying waits for the controller that replaces it
and sends the same request again, with the same request ID. For CLEAR the first copy may
have been applied and journaled: applied again, it would remove a put made in between (the
kill history test found a clear applied twice across a controller restart). The journal
keeps each clear's reply with its change, so the new controller answers the copy with it.
"""
from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import api

pytestmark = [pytest.mark.timeout(180), pytest.mark.strict]

P = "p"


def _put(key: str, value: int) -> None:
    tq.kv_batch_put([key], P, TensorDict({"x": torch.tensor([[value]])}, batch_size=[1]),
                    tags=[{"v": value}])


def _restart_controller() -> None:
    dep = api._deployment
    before = dep.incarnation
    dep.restart_controller()
    assert dep.incarnation != before
    client = tq.get_client()
    deadline = time.monotonic() + 60
    while not client.controller.call("TOPOLOGY")["ready"]:
        assert time.monotonic() < deadline, "the units did not re-register"
        time.sleep(0.05)


def test_a_clear_resent_after_a_restart_gets_its_reply_and_spares_a_later_put(tq_start):
    tq_start(num_units=2)
    client = tq.get_client()
    _put("a", 1)
    _put("b", 1)
    first = client.controller.call("CLEAR", {"partition_id": P, "keys": ["a"]}, rid="clear-1")
    assert len(first["freed"]) == 1
    _put("a", 2)  # another put of the key after the clear took effect
    _restart_controller()
    # the copy of the first request, as a client whose reply was lost sends it
    again = client.controller.call("CLEAR", {"partition_id": P, "keys": ["a"]}, rid="clear-1")
    assert again == first
    assert tq.kv_list(P)[P] == {"a": {"v": 2}, "b": {"v": 1}}
    assert tq.kv_batch_get(["a"], P)["x"].tolist() == [[2]]
    # a new clear (another request ID) still clears
    tq.kv_clear(["a"], P)
    assert list(tq.kv_list(P)[P]) == ["b"]


def test_a_commit_resent_after_a_restart_gets_its_reply_and_is_not_applied_again(tq_start):
    """A put whose controller was replaced sends its COMMIT_PUT to the new one with the same
    request ID: one the last controller committed is answered from the journal; one it
    never saw commits the keys still at their generations and names the keys that were
    new (pending under the last controller, which never journaled them) for a redo."""
    tq_start(num_units=2)
    client = tq.get_client()
    tq.kv_batch_put(["old"], P, tags=[{"v": 0}])
    alloc = client.controller.call("ALLOC", {"partition_id": P, "keys": ["a"], "schemas": {}})
    body = {"partition_id": P, "keys": ["a"], "fields": [], "tags": [{"v": 1}],
            "gens": alloc["gens"]}
    first = client.controller.call("COMMIT_PUT", body, rid="commit-1")
    tq.kv_batch_put(["a"], P, tags=[{"v": 2}])  # a later put of the key
    late = client.controller.call("ALLOC", {"partition_id": P, "keys": ["old", "new"],
                                            "schemas": {}})
    _restart_controller()
    again = client.controller.call("COMMIT_PUT", body, rid="commit-1")
    assert again == first
    assert tq.kv_list(P)[P] == {"old": {"v": 0}, "a": {"v": 2}}
    # ALLOCed under the last controller, committed to this one: "old" still holds its
    # generation and is committed; "new" was pending there, so it is named for a redo
    out = client.controller.call("COMMIT_PUT", {
        "partition_id": P, "keys": ["old", "new"], "fields": [], "tags": [{"v": 3}, {"v": 3}],
        "gens": late["gens"]}, rid="commit-2")
    assert out["stale"] == ["new"] and out["redo"] == ["new"]
    assert tq.kv_list(P)[P] == {"old": {"v": 3}, "a": {"v": 2}}
