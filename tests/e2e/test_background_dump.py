"""Snapshot-consistent, non-blocking dumps (dump_data_by_key(..., block=False))."""
from __future__ import annotations

import os
import time

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from buffers import assert_same_rows, assert_same_value, rollout_batch
from tqtx import format as fmt
from tqtx.dump.save import DumpCancelled
from tqtx.errors import PeerDiedError
from tqtx.journal.dump import DumpJournal


def test_dump_holds_the_snapshot_despite_immediate_changes(tq_shared, pid, tmp_path):
    keys, td, tags = rollout_batch(30)
    tq.kv_batch_put(keys, pid, td, tags=tags)
    ref = tq.kv_batch_get(keys, pid)
    handle = tq.dump_data_by_key(tmp_path / "d", keys, pid, block=False)
    assert isinstance(handle, tq.DumpHandle) and handle.dump_dir == str(tmp_path / "d")
    # right after the call returns: overwrite, re-tag, clear and re-create selected keys
    _, td2, tags2 = rollout_batch(30, seed=9)
    tq.kv_batch_put(keys[:10], pid, td2[:10], tags=[{"status": "changed"}] * 10)
    tq.kv_clear(keys[10:20], pid)
    tq.kv_batch_put(keys[10:15], pid, td2[10:15])  # may reuse the freed indexes
    # one field of rows the snapshot holds whole, in place on the unit (copy on write)
    tq.kv_batch_put(keys[20:25], pid, TensorDict({"obs": torch.zeros(5, 4)}, batch_size=[5]))
    rep = handle.result(timeout=60)
    assert handle.done() and rep["keys"] == 30 and rep["dump_id"] == handle.dump_id
    assert handle.critical_path_seconds is not None
    idx = tq.read_row_index(tmp_path / "d")
    for k, t in zip(keys, tags):
        assert_same_value(idx["rows"][k]["tag"], t, k)
    tq.kv_clear(keys, pid)
    tq.load_data_by_key(tmp_path / "d")
    assert_same_rows(ref, tq.kv_batch_get(keys, pid), keys)


def test_other_keys_are_served_while_a_dump_is_written(tq_start, tmp_path):
    tq_start(2, unit_env={0: {"TQTX_FAULTS": "unit.dump.before_write:delay:3"},
                          1: {"TQTX_FAULTS": "unit.dump.before_write:delay:3"}})
    n = 64
    big = TensorDict({"x": torch.randn(n, 65536)}, batch_size=[n])  # 16 MiB
    keys = [f"big{i}" for i in range(n)]
    tq.kv_batch_put(keys, "p", big)
    handle = tq.dump_data_by_key(tmp_path / "d", keys, "p", block=False)
    served = 0
    t0 = time.monotonic()
    while not handle.done() and time.monotonic() - t0 < 30:
        tq.kv_put(f"o{served}", "other", {"y": torch.full((3,), float(served))})
        got = tq.kv_batch_get([f"o{served}"], "other")["y"][0]
        assert got[0].item() == served
        served += 1
        if served >= 20:
            break
    assert served >= 20 and not handle.done()  # puts and gets flowed during the write
    rep = handle.result(timeout=60)
    assert rep["rows_with_data"] == n and fmt.verify_dump(tmp_path / "d")["ok"]


@pytest.mark.slow
def test_unit_crash_mid_background_write_keeps_previous_dump(tq_start, tmp_path):
    tq_start(2, unit_env={1: {"TQTX_FAULTS": "unit.dump.before_write@2:kill"}})
    keys, td, tags = rollout_batch(12)
    tq.kv_batch_put(keys, "p", td, tags=tags)
    first = tq.dump_data_by_key(tmp_path / "d", keys[:6], "p")
    handle = tq.dump_data_by_key(tmp_path / "d", keys, "p", block=False)
    with pytest.raises(PeerDiedError, match=r"unit 1 at \S+ is gone"):
        handle.result(timeout=60)
    assert tq.read_row_index(tmp_path / "d")["dump_id"] == first["dump_id"]
    assert fmt.verify_dump(tmp_path / "d")["ok"]
    with DumpJournal(tmp_path / "d") as dj:
        assert [p["phase"] for p in dj.publications()] in (["cleaned", "failed"],
                                                          ["failed", "cleaned"])
    parent = tmp_path
    assert not [x for x in os.listdir(parent) if ".tmp-" in x or x.endswith(".old")]


@pytest.mark.slow
def test_cancel_and_close_with_outstanding_dumps(tq_start, tmp_path):
    tq_start(2, env={"TQTX_FAULTS": "unit.dump.before_write:delay:2"})
    keys, td, tags = rollout_batch(12)
    tq.kv_batch_put(keys, "p", td, tags=tags)
    first = tq.dump_data_by_key(tmp_path / "d", keys[:3], "p")
    handle = tq.dump_data_by_key(tmp_path / "d", keys, "p", block=False)
    assert handle.cancel() is True
    with pytest.raises(DumpCancelled, match="was cancelled"):
        handle.result()
    assert tq.read_row_index(tmp_path / "d")["dump_id"] == first["dump_id"]
    with DumpJournal(tmp_path / "d") as dj:
        # cancelled before or after its publication attempt began: never published
        assert sorted(p["phase"] for p in dj.publications()) in (["cleaned"],
                                                                 ["cleaned", "failed"])
        assert dj.unfinished_publications() == []
    # close waits for outstanding dumps and says which
    h2 = tq.dump_data_by_key(tmp_path / "e", keys, "p", block=False)
    report = tq.close()
    assert report["waited"] == [h2.dump_id] and h2.done()
    assert h2.result()["keys"] == 12 and fmt.verify_dump(tmp_path / "e")["ok"]
    # or cancels them
    tq_start(2, env={"TQTX_FAULTS": "unit.dump.before_write:delay:2"})
    tq.kv_batch_put(keys, "p", td, tags=tags)
    h3 = tq.dump_data_by_key(tmp_path / "f", keys, "p", block=False)
    report = tq.close(cancel_dumps=True)
    assert report["cancelled"] == [h3.dump_id]
    assert not (tmp_path / "f").exists()


def test_second_dump_to_the_same_path_waits(tq_start, tmp_path):
    tq_start(2, env={"TQTX_FAULTS": "unit.dump.before_write:delay:1"})
    keys, td, tags = rollout_batch(8)
    tq.kv_batch_put(keys, "p", td, tags=tags)
    h1 = tq.dump_data_by_key(tmp_path / "d", keys[:4], "p", block=False)
    rep2 = tq.dump_data_by_key(tmp_path / "d", keys[4:], "p")  # waits for the lock
    assert h1.done() and h1.result()["keys"] == 4
    assert list(tq.read_row_index(tmp_path / "d")["rows"]) == keys[4:]
    assert rep2["keys"] == 4
