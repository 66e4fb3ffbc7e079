"""kv_batch_put on one host with real unit processes: units read the put's tensor rows out
of the client's memory (PUT_ROWS with ``from``), exactly, into memory of their own; a unit
that cannot prove the client's inbox gets the rows as frames; TQTX_PUT_FROM=off sends
frames. Dense columns are compared, so in strict mode."""
from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from buffers import same_host_batch as _batch
from tqtx.client import put_from
from tqtx.wire import vmcopy

pytestmark = [pytest.mark.strict,
              pytest.mark.skipif(not vmcopy.available(), reason="needs process_vm_readv")]


def _check(got, td, jag):
    assert torch.equal(got["dense"], td["dense"])
    assert torch.equal(got["reward"], td["reward"])
    assert all(torch.equal(a, b) for a, b in zip(got["tokens"].unbind(), jag))
    assert list(got["text"]) == [f"sample {i}" for i in range(len(jag))]


def _reads() -> list[int]:
    return [u["put_reads"] for u in tq.get_client().stats()["units"]]


def _put_and_check(pid, n=90, seed=1):
    td, jag = _batch(n, seed)
    keys = [f"k{i}" for i in range(n)]
    tq.kv_batch_put(keys, pid, td)
    want = td.clone()
    jag_want = [j.clone() for j in jag]
    td["dense"].add_(1)  # the units hold copies of their own: changing the source is free
    td.get("tokens").values().add_(1)
    _check(tq.kv_batch_get(keys, pid), want, jag_want)
    return keys


def test_units_read_a_same_host_put_from_the_client(tq_start, pid, monkeypatch):
    monkeypatch.setattr(put_from, "MIN_BYTES", 0)
    tq_start(3)
    keys = _put_and_check(pid)
    assert _reads() == [1, 1, 1]
    # overwrite every key (a merge of the same generation for a subset of fields too)
    td, jag = _batch(len(keys), 7)
    tq.kv_batch_put(keys, pid, td)
    _check(tq.kv_batch_get(keys, pid), td, jag)
    tq.kv_batch_put(keys[:30], pid, TensorDict({"dense": torch.zeros(30, 33)}, [30]))
    assert torch.equal(tq.kv_batch_get(keys[:30], pid)["dense"], torch.zeros(30, 33))
    assert _reads() == [3, 3, 3]
    assert tq.get_client().put_from_refused == {}


def test_a_unit_that_cannot_prove_the_inbox_gets_frames(tq_start, pid, monkeypatch):
    monkeypatch.setattr(put_from, "MIN_BYTES", 0)
    tq_start(2)
    hint = put_from.hint
    monkeypatch.setattr(put_from, "hint", lambda c: dict(hint(c), token="0" * 32))
    _put_and_check(pid)
    assert _reads() == [0, 0]
    assert set(tq.get_client().put_from_refused) == {0, 1}
    _put_and_check(pid + "b", seed=3)  # now frames at once
    assert _reads() == [0, 0]


def test_put_from_can_be_turned_off(tq_start, pid, monkeypatch):
    monkeypatch.setattr(put_from, "MIN_BYTES", 0)
    monkeypatch.setenv("TQTX_PUT_FROM", "off")
    tq_start(2)
    _put_and_check(pid)
    assert _reads() == [0, 0]
    assert tq.get_client().put_from_off == "TQTX_PUT_FROM is off"


@pytest.mark.parametrize("durability", ["buffer", "sync"])
def test_rows_read_from_the_client_reach_the_row_log(tq_start, pid, monkeypatch, tmp_path,
                                                     durability):
    """A whole-job restart brings back rows the units read from the client."""
    monkeypatch.setattr(put_from, "MIN_BYTES", 0)
    state = str(tmp_path / "state")
    tq_start(2, state_dir=state, durability=durability, flush_interval_s=0.05)
    td, jag = _batch(40, 4)
    keys = [f"k{i}" for i in range(40)]
    tq.kv_batch_put(keys, pid, td)
    assert _reads() == [1, 1]
    tq.close(keep_buffer=True)
    tq_start(2, state_dir=state, durability=durability, flush_interval_s=0.05)
    _check(tq.kv_batch_get(keys, pid), td, jag)


@pytest.mark.parametrize("action", ["raise", "kill"])
def test_a_put_a_unit_failed_after_reading_leaves_nothing(tq_start, pid, monkeypatch, action):
    """A unit that fails (or dies) between reading a same-host put and storing it: the put
    raises and leaves no key; put again (the unit raised once), it is stored exactly."""
    monkeypatch.setattr(put_from, "MIN_BYTES", 0)
    tq_start(2, env={"TQTX_FAULTS": f"unit.put.after_read@1:{action}"})
    td, jag = _batch(40, 5)
    keys = [f"k{i}" for i in range(40)]
    with pytest.raises(Exception):
        tq.kv_batch_put(keys, pid, td)
    assert not tq.kv_list(pid).get(pid)
    if action == "raise":
        tq.kv_batch_put(keys, pid, td)
        _check(tq.kv_batch_get(keys, pid), td, jag)
