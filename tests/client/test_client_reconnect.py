"""Clients carry on across a controller restart (issue 15, client side).

A real deployment (controller + 2 units as child processes, loopback). The controller is
killed (or restarted on the same state dir and port) under an attached client: its next
calls reconnect by themselves; a put in flight is redone once from ALLOC or fails with a
clear error; a controller that does not come back is given up on after the bound.
These tests use keys put after the restart only: what survives of the earlier ones is the
controller's durable metadata, tested with it.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import PeerDiedError, api, faults
from tqtx.client import Client
from tqtx.wire.peer import Peer

pytestmark = pytest.mark.strict  # the tests compare dense columns


def _batch(prefix: str, n: int = 6, base: int = 0):
    keys = [f"{prefix}{i}" for i in range(n)]
    return keys, TensorDict({"x": torch.arange(base, base + n * 3).reshape(n, 3)},
                            batch_size=[n])


def _units_back(dep, addresses, wait: float = 3.0) -> None:
    """Wait for the units to re-register with the new controller; register them by hand
    at their unchanged addresses if they do not (until units re-register by themselves)."""
    peer = Peer(dep.address, "controller", timeout=5.0)
    try:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if peer.call("TOPOLOGY")["ready"]:
                return
            time.sleep(0.1)
        for uid, address in enumerate(addresses):
            peer.call("REGISTER_UNIT", {
                "unit_id": uid, "address": address, "staged": [],
                "held": {"indexes": [], "field_sets": [], "fields_of": []}})
        assert peer.call("TOPOLOGY")["ready"]
    finally:
        peer.close()


def _restart(dep, addresses, **kwargs) -> int:
    before = dep.incarnation
    dep.restart_controller(**kwargs)
    assert dep.incarnation != before
    _units_back(dep, addresses)
    return dep.incarnation


def _wait_exit(proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the controller did not die at its fault point"
        time.sleep(0.05)


def test_attached_clients_carry_on_after_a_controller_restart(tq_start, pid):
    cfg = tq_start(2)
    dep, client = api._deployment_handle(), tq.get_client()
    by_address = Client(cfg["address"], timeout=30)  # attached by address: no liveness
    try:
        keys, td = _batch("a")
        tq.kv_batch_put(keys, pid, td)
        address = dep.address
        incarnation = _restart(dep, list(client.unit_addresses))
        assert dep.address == address  # same address, new incarnation

        keys, td = _batch("b", base=100)
        meta = tq.kv_batch_put(keys, pid, td, tags=[{"i": i} for i in range(len(keys))])
        assert meta.fields == ["x"]
        assert client.controller_incarnation == incarnation
        assert torch.equal(tq.kv_batch_get(keys, pid)["x"], td["x"])
        listed = tq.kv_list(pid)[pid]
        assert {k: listed[k] for k in keys} == {k: {"i": i} for i, k in enumerate(keys)}

        assert set(keys) <= set(by_address.list_keys(pid)[pid])
        other = [f"c{i}" for i in range(3)]
        by_address.put_columns(other, pid, {}, {}, None)
        assert set(other) <= set(tq.kv_list(pid)[pid])
    finally:
        by_address.close()


def test_a_commit_in_flight_when_the_controller_dies_is_redone_after_the_restart(tq_start, pid):
    tq_start(2, env={"TQTX_FAULTS": "controller.request.COMMIT_PUT:kill"})
    dep, client = api._deployment_handle(), tq.get_client()
    addresses = list(client.unit_addresses)
    keys, td = _batch("k", base=7)
    outcome: dict = {}

    def put():
        try:
            outcome["meta"] = tq.kv_batch_put(keys, pid, td, tags=[{"n": 1}] * len(keys))
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    t = threading.Thread(target=put)
    t.start()
    _wait_exit(dep.procs["controller"])          # it received COMMIT_PUT and died
    _restart(dep, addresses, env={"TQTX_FAULTS": ""})
    t.join(60)
    assert not t.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["meta"].fields == ["x"]
    assert torch.equal(tq.kv_batch_get(keys, pid)["x"], td["x"])
    assert {k: t for k, t in tq.kv_list(pid)[pid].items() if k in keys} == \
        {k: {"n": 1} for k in keys}


def test_a_restart_between_put_rows_and_commit_is_redone_or_clear(tq_start, pid,
                                                                  point_reached):
    """The fault point client.put.before_commit holds the put (a delay) while the
    controller is killed and restarted: the put succeeds after the restart, or raises
    the clear error; its keys are never half-visible."""
    tq_start(2)
    dep, client = api._deployment_handle(), tq.get_client()
    addresses = list(client.unit_addresses)
    reached = point_reached("client.put.before_commit")
    faults.configure("client.put.before_commit@1:delay:1.0")
    try:
        keys, td = _batch("m", base=50)
        outcome: dict = {}

        def put():
            try:
                outcome["meta"] = tq.kv_batch_put(keys, pid, td)
            except BaseException as exc:
                outcome["error"] = exc

        t = threading.Thread(target=put)
        t.start()
        assert reached.wait(30)
        _restart(dep, addresses)
        t.join(60)
        assert not t.is_alive()
    finally:
        faults.configure("")
    if "error" in outcome:
        assert isinstance(outcome["error"], PeerDiedError), outcome["error"]
        assert "did not come back" in str(outcome["error"]) or "restarted twice" in str(
            outcome["error"])
        assert not set(keys) & set(tq.kv_list(pid).get(pid, {}))
    else:
        assert torch.equal(tq.kv_batch_get(keys, pid)["x"], td["x"])
        assert set(keys) <= set(tq.kv_list(pid)[pid])


@pytest.mark.slow
def test_reconnect_gives_up_after_the_bound_with_a_clear_error(tq_start, pid):
    tq_start(2)
    dep, client = api._deployment_handle(), tq.get_client()
    keys, td = _batch("g")
    tq.kv_batch_put(keys, pid, td)
    client.reconnect_timeout = 2.0
    dep.stop_controller()
    t0 = time.monotonic()
    with pytest.raises(PeerDiedError) as ei:
        tq.kv_list(pid)
    msg = str(ei.value)
    assert f"the controller at {dep.address} did not come back within 2s" in msg, msg
    assert "while listing keys" in msg and "nothing was changed" in msg, msg
    keys, td = _batch("h")
    with pytest.raises(PeerDiedError, match="none of its keys was stored or committed"):
        tq.kv_batch_put(keys, pid, td)
    assert time.monotonic() - t0 < 20


def test_closing_the_client_ends_a_wait_for_the_controller_in_another_thread(tq_start, pid):
    """A thread whose call found the controller gone waits for it (up to the reconnect
    bound); closing the client (the job ending) ends that wait with PeerDiedError saying
    so, instead of the thread waiting out the bound."""
    tq_start(2)
    dep, client = api._deployment_handle(), tq.get_client()
    client.reconnect_timeout = 600.0
    dep.stop_controller()
    waiting, outcome = threading.Event(), []
    real = client.await_controller

    def noted(*args, **kwargs):
        waiting.set()
        return real(*args, **kwargs)
    client.await_controller = noted

    def lister():
        try:
            outcome.append(client.call_controller("LIST", {}, what="listing keys"))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)
    t = threading.Thread(target=lister, daemon=True)
    t.start()
    assert waiting.wait(30)
    client.close()
    t.join(60)
    assert not t.is_alive() and len(outcome) == 1
    assert isinstance(outcome[0], PeerDiedError), outcome
    assert "this client was closed while listing keys" in str(outcome[0])


@pytest.mark.slow
def test_a_commit_lost_with_the_controller_names_what_is_uncertain(tq_start, pid):
    tq_start(2, env={"TQTX_FAULTS": "controller.request.COMMIT_PUT:kill"})
    client = tq.get_client()
    client.reconnect_timeout = 1.5
    keys, td = _batch("u")
    with pytest.raises(PeerDiedError) as ei:
        tq.kv_batch_put(keys, pid, td)
    msg = str(ei.value)
    assert "did not come back within 1.5s" in msg, msg
    assert f"putting {len(keys)} key(s) in partition {pid!r}" in msg, msg
    assert "commit may not have been applied" in msg, msg
