"""Two puts of the same new key: which one is put again after the key moved.

Both puts get the key's one pending index and generation at ALLOC. When the other put
commits, the key becomes visible with whichever rows the units hold last, this put's
included; a clear that then removes it came after this put, so this put must not create
the key again at its own commit (it would bring back a value a reader saw before the clear:
the kill history test found it). Only a key whose creation was abandoned (the other put
failed, so its rows were never visible) is put again.
"""
from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import faults

# the interleavings of ALLOC's path (a lease would skip ALLOC: tqtx/client/lease.py)
pytestmark = [pytest.mark.timeout(120), pytest.mark.strict, pytest.mark.usefixtures("no_lease")]

P = "p"


def _td(value: int) -> TensorDict:
    return TensorDict({"x": torch.tensor([[value]])}, batch_size=[1])


def test_a_new_key_committed_by_a_concurrent_put_and_cleared_is_not_put_again(
        tq_start, monkeypatch):
    tq_start(num_units=2)
    tq.kv_batch_put(["other"], P, _td(0))
    main = threading.current_thread()
    real = faults.hit
    b_at_commit, b_go = threading.Event(), threading.Event()
    seen: dict = {}
    b_error: list = []

    def put_b():
        try:
            tq.kv_batch_put(["n"], P, _td(2))
        except BaseException as exc:  # reported by the assertion below
            b_error.append(exc)

    def spy(name):
        me = threading.current_thread()
        if me is not main:
            if name == "client.put.before_commit":
                b_at_commit.set()   # B allocated "n" and wrote its row
                assert b_go.wait(30)
            return real(name)
        if name == "client.put.after_alloc" and "b" not in seen:
            # A has "n" pending; B allocates the same pending row and writes it first
            seen["b"] = threading.Thread(target=put_b, daemon=True)
            seen["b"].start()
            assert b_at_commit.wait(30)
        elif name == "client.put.before_commit" and "cleared" not in seen:
            # A's row is on the unit now (written after B's); B commits: "n" is visible
            b_go.set()
            seen["b"].join(30)
            assert not b_error, b_error
            seen["read"] = tq.kv_batch_get(["n"], P)["x"].tolist()
            tq.kv_clear(["n"], P)
            seen["cleared"] = True
        return real(name)

    monkeypatch.setattr(faults, "hit", spy)
    tq.kv_batch_put(["n"], P, _td(1))
    monkeypatch.setattr(faults, "hit", real)
    assert seen["read"] == [[1]]  # A's value was visible before the clear
    # the clear came after A's put: "n" stays cleared
    with pytest.raises(tq.KeysNotFoundError):
        tq.kv_batch_get(["n"], P)
    assert list(tq.kv_list(P)[P]) == ["other"]
