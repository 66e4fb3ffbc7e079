"""TransferQueue 0.1.11's end-to-end checkpoint tests (its wheel's
``tests/e2e/test_checkpoint_e2e.py``) restated against tqtx with the default config. Where
TransferQueue wipes its controller actor's partitions before a load, this suite clears the
keys (``kv_clear``); where it reads the actor's key mapping, ``kv_list``. tqtx writes its own
files besides ``metadata.json`` (no pickle: docs/compatibility.md), so the test that lists
TransferQueue's file names checks tqtx's layout instead."""
from __future__ import annotations

import json

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tqtx as tq

TQ_CONFIG = {"controller": {"polling_mode": True},
             "backend": {"storage_backend": "SimpleStorage",
                         "SimpleStorage": {"total_storage_size": 200, "num_data_storage_units": 2}}}


@pytest.fixture
def tq_system(tq_start):
    return tq_start(**TQ_CONFIG)


@pytest.fixture
def checkpoint_dir(tmp_path):
    return tmp_path / "checkpoint"


def same(got, want):
    rows = list(got.unbind()) if got.is_nested else list(got.unbind(0))
    assert len(rows) == len(want) and all(torch.equal(a, b) for a, b in zip(rows, want))


def wipe():
    for pid, keys in tq.kv_list().items():
        tq.kv_clear(list(keys), pid)
    assert tq.kv_list() == {}


def test_tensor_fields(tq_system, checkpoint_dir):
    keys, ids, mask = ["k0", "k1"], torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2)
    tq.kv_batch_put(keys=keys, partition_id="p_tensor", tags=[{}, {}],
                    fields=TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=2))
    tq.save_checkpoint(checkpoint_dir)
    meta = json.loads((checkpoint_dir / "metadata.json").read_text())
    assert meta["storage_saved"] is True
    assert (checkpoint_dir / "checkpoint_info.json").exists()  # tqtx's own layout
    wipe()
    tq.load_checkpoint(checkpoint_dir)
    assert "p_tensor" in tq.kv_list()
    got = tq.kv_batch_get(keys=keys, partition_id="p_tensor")
    same(got["input_ids"], list(ids))
    same(got["attention_mask"], list(mask))


def test_controller_metadata(tq_system, checkpoint_dir):
    keys = ["a0", "a1", "a2"]
    tq.kv_batch_put(keys=keys, partition_id="p_meta", tags=[{"idx": i} for i in range(3)],
                    fields=TensorDict({"input_ids": torch.arange(9).reshape(3, 3),
                                       "attention_mask": torch.ones(3, 3)}, batch_size=3))
    tq.save_checkpoint(checkpoint_dir)
    wipe()
    tq.load_checkpoint(checkpoint_dir)
    assert tq.kv_list("p_meta")["p_meta"] == {k: {"idx": i} for i, k in enumerate(keys)}


def test_multiple_partitions(tq_system, checkpoint_dir):
    data = {f"part_{i}": torch.full((2, 4), i, dtype=torch.long) for i in range(3)}
    for pid, ids in data.items():
        tq.kv_batch_put(keys=[f"{pid}_k0", f"{pid}_k1"], partition_id=pid, tags=[{}, {}],
                        fields=TensorDict({"input_ids": ids, "attention_mask": torch.ones(2, 4)},
                                          batch_size=2))
    tq.save_checkpoint(checkpoint_dir)
    wipe()
    tq.load_checkpoint(checkpoint_dir)
    for pid, ids in data.items():
        got = tq.kv_batch_get(keys=[f"{pid}_k0", f"{pid}_k1"], partition_id=pid,
                              select_fields=["input_ids"])
        same(got["input_ids"], list(ids))


def test_user_metadata_preserved(tq_system, checkpoint_dir):
    tq.kv_batch_put(keys=["m0"], partition_id="p_usermeta", tags=[{}],
                    fields=TensorDict({"input_ids": torch.tensor([[10, 20]]),
                                       "attention_mask": torch.ones(1, 2)}, batch_size=1))
    tq.save_checkpoint(checkpoint_dir, metadata={"iteration": 42, "loss": 0.5})
    meta = json.loads((checkpoint_dir / "metadata.json").read_text())
    assert meta["user_metadata"]["iteration"] == 42
    assert meta["user_metadata"]["loss"] == pytest.approx(0.5)


def test_non_tensor_fields(tq_system, checkpoint_dir):
    ids = torch.tensor([[1, 2], [3, 4]])
    tq.kv_batch_put(keys=["t0", "t1"], partition_id="p_str", tags=[{}, {}], fields=TensorDict(
        {"input_ids": ids, "text": NonTensorStack("hello", "world")}, batch_size=2))
    tq.save_checkpoint(checkpoint_dir)
    wipe()
    tq.load_checkpoint(checkpoint_dir)
    got = tq.kv_batch_get(keys=["t0", "t1"], partition_id="p_str")
    same(got["input_ids"], list(ids))
    assert got["text"].tolist() == ["hello", "world"]


def test_nested_tensor_fields(tq_system, checkpoint_dir):
    keys = ["j0", "j1", "j2"]
    for i, key in enumerate(keys):
        tq.kv_put(key=key, partition_id="p_jagged", tag=None, fields=TensorDict(
            {"seq": torch.arange(i + 1, dtype=torch.float).unsqueeze(0)}, batch_size=1))
    tq.save_checkpoint(checkpoint_dir)
    wipe()
    tq.load_checkpoint(checkpoint_dir)
    got = tq.kv_batch_get(keys=keys, partition_id="p_jagged", select_fields=["seq"])
    for i, row in enumerate(got["seq"].unbind()):
        assert torch.equal(row, torch.arange(i + 1, dtype=torch.float))


def test_include_storage_false_still_saves_and_restores_the_rows(tq_system, checkpoint_dir):
    keys, ids = ["n0", "n1"], torch.tensor([[5, 6], [7, 8]])
    tq.kv_batch_put(keys=keys, partition_id="p_nometa", tags=[{}, {}], fields=TensorDict(
        {"input_ids": ids, "attention_mask": torch.ones(2, 2)}, batch_size=2))
    tq.save_checkpoint(checkpoint_dir, include_storage=False)
    assert json.loads((checkpoint_dir / "metadata.json").read_text())["storage_saved"] is True
    wipe()
    tq.load_checkpoint(checkpoint_dir)
    assert sorted(tq.kv_list("p_nometa")["p_nometa"]) == keys
    same(tq.kv_batch_get(keys=keys, partition_id="p_nometa")["input_ids"], list(ids))


# ---------------------------------------------------------------- errors
def test_save_and_load_raise_if_not_initialized(tmp_path):
    tq.close()
    for call in (lambda: tq.save_checkpoint(tmp_path / "ck"),
                 lambda: tq.load_checkpoint(tmp_path / "ck")):
        with pytest.raises(RuntimeError, match="not initialized"):
            call()


def test_load_raises_if_dir_or_metadata_missing(tq_system, tmp_path):
    with pytest.raises(FileNotFoundError):
        tq.load_checkpoint(tmp_path / "nonexistent")
    ck = tmp_path / "ck"
    ck.mkdir()
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        tq.load_checkpoint(ck)


def test_load_raises_on_storage_unit_count_mismatch(tq_start, checkpoint_dir):
    tq_start(**TQ_CONFIG)
    tq.kv_batch_put(keys=["e0"], partition_id="p_err", tags=[{}], fields=TensorDict(
        {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2)}, batch_size=1))
    tq.save_checkpoint(checkpoint_dir)
    tq_start(3, **TQ_CONFIG)
    with pytest.raises(ValueError, match="count mismatch"):
        tq.load_checkpoint(checkpoint_dir)


def test_no_partial_state_on_failed_save(tq_start, tmp_path):
    tq_start(**TQ_CONFIG, unit_env={1: {"TQTX_FAULTS": "unit.request.SAVE_CHECKPOINT:raise"}})
    tq.kv_batch_put(keys=["f0", "f1"], partition_id="p_fail", tags=[{}, {}], fields=TensorDict(
        {"input_ids": torch.tensor([[1, 2], [3, 4]])}, batch_size=2))
    ck = tmp_path / "ck"
    with pytest.raises(RuntimeError, match="fault injected"):  # the unit's error, as raised
        tq.save_checkpoint(ck)
    assert not ck.exists()
    # beside it only tqtx's own bookkeeping (the checkpoint's lock and SQLite journal), no
    # staging directory
    beside = [p for p in tmp_path.iterdir() if p.name.startswith("ck")]
    assert not [p for p in beside if p.is_dir()]
    assert {p.name for p in beside} - {"ck.lock"} <= {"ck.journal.sqlite",
                                                      "ck.journal.sqlite-journal"}
