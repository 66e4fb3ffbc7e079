"""The seed PR's end-to-end dump tests (TransferQueue's ``tests/e2e/test_data_dump_e2e.py``
of the dump_data_by_key / load_data_by_key PR) restated against tqtx with the default
config. The seed tests read and wipe partitions through the controller actor's internals;
this suite uses ``kv_list`` / ``kv_clear``. Tests of the seed PR's own file layout
(pickled shards, ``row_index.pt``, a version-1 pickle dump) and of its controller-internal
restore protocol have tqtx counterparts (tests/e2e/test_dump.py, test_restore.py) and are
listed in docs/compatibility.md where tqtx deliberately differs."""
from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tqtx as tq
from tqtx import format as fmt

pytestmark = pytest.mark.usefixtures("tq_shared")


@pytest.fixture
def dump_dir(tmp_path):
    return tmp_path / "case" / "dump"


def _ids(row: int) -> torch.Tensor:
    return torch.tensor([row * 10, row * 10 + 1, row * 10 + 2])


def _put_rows(pid, keys):
    tq.kv_batch_put(keys=keys, partition_id=pid, tags=[{"idx": i} for i in range(len(keys))],
                    fields=TensorDict({"input_ids": torch.stack([_ids(i) for i in range(len(keys))]),
                                       "attention_mask": torch.ones(len(keys), 3)},
                                      batch_size=len(keys)))


def _wipe(pid):
    keys = list(tq.kv_list(pid).get(pid, {}))
    if keys:
        tq.kv_clear(keys, pid)


def _rows_equal(col, want):
    rows = list(col.unbind()) if col.is_nested else list(col)
    assert len(rows) == len(want) and all(torch.equal(a, b) for a, b in zip(rows, want))


def test_only_selected_keys_are_restored(pid, dump_dir):
    keys, selected = [f"k{i}" for i in range(6)], ["k1", "k4"]
    _put_rows(pid, keys)
    report = tq.dump_data_by_key(dump_dir, selected, pid)
    assert (report["keys"], report["rows_with_data"]) == (2, 2)
    _wipe(pid)
    tq.load_data_by_key(dump_dir)
    assert sorted(tq.kv_list(pid)[pid]) == selected
    got = tq.kv_batch_get(keys=selected, partition_id=pid, select_fields=["input_ids"])
    _rows_equal(got["input_ids"], [_ids(keys.index(k)) for k in selected])


def test_tags_survive_the_roundtrip(pid, dump_dir):
    keys = [f"t{i}" for i in range(5)]
    _put_rows(pid, keys)
    tq.dump_data_by_key(dump_dir, ["t0", "t3"], pid)
    _wipe(pid)
    tq.load_data_by_key(dump_dir)
    assert tq.kv_list(pid)[pid] == {"t0": {"idx": 0}, "t3": {"idx": 3}}


def test_jagged_and_non_tensor_fields_survive(pid, dump_dir):
    keys = ["j0", "j1", "j2"]
    for row, key in enumerate(keys):
        tq.kv_put(key=key, partition_id=pid, tag=None, fields=TensorDict(
            {"seq": torch.arange(row + 1, dtype=torch.float).unsqueeze(0),
             "text": NonTensorStack(f"row-{row}")}, batch_size=1))
    tq.dump_data_by_key(dump_dir, keys, pid)
    _wipe(pid)
    tq.load_data_by_key(dump_dir)
    got = tq.kv_batch_get(keys=keys, partition_id=pid, select_fields=["seq", "text"])
    for row, part in enumerate(got["seq"].unbind()):
        assert torch.equal(part, torch.arange(row + 1, dtype=torch.float))
    assert list(got["text"]) == [f"row-{row}" for row in range(3)]


def test_heterogeneous_field_sets_are_grouped(pid, dump_dir):
    _put_rows(pid, ["h0", "h1", "h2"])
    tq.kv_put(key="h1", partition_id=pid, tag=None,
              fields=TensorDict({"routed_experts": torch.tensor([[7, 8]])}, batch_size=1))
    tq.dump_data_by_key(dump_dir, ["h0", "h1", "h2"], pid)
    _wipe(pid)
    tq.load_data_by_key(dump_dir)
    rows = tq.read_row_index(dump_dir)["rows"]
    assert "routed_experts" in rows["h1"]["fields"] and "routed_experts" not in rows["h0"]["fields"]
    got = tq.kv_batch_get(keys=["h1"], partition_id=pid, select_fields=["routed_experts"])
    _rows_equal(got["routed_experts"], [torch.tensor([7, 8])])


def test_other_partitions_are_untouched(pid, dump_dir):
    _put_rows(pid + "-target", ["a0", "a1"])
    _put_rows(pid + "-by", ["b0", "b1"])
    tq.dump_data_by_key(dump_dir, ["a0"], pid + "-target")
    _wipe(pid + "-target")
    tq.load_data_by_key(dump_dir)
    assert {pid + "-by", pid + "-target"} <= set(tq.kv_list())
    got = tq.kv_batch_get(keys=["b0", "b1"], partition_id=pid + "-by", select_fields=["input_ids"])
    _rows_equal(got["input_ids"], [_ids(0), _ids(1)])


def test_row_without_produced_fields_keeps_its_key(pid, dump_dir):
    _put_rows(pid, ["p0"])
    tq.get_client().kv_retrieve_meta(keys=["empty0"], partition_id=pid, create=True)
    report = tq.dump_data_by_key(dump_dir, ["p0", "empty0"], pid)
    assert (report["keys"], report["rows_with_data"]) == (2, 1)
    _wipe(pid)
    tq.load_data_by_key(dump_dir)
    assert sorted(tq.kv_list(pid)[pid]) == ["empty0", "p0"]


def test_duplicate_keys_are_deduplicated(pid, dump_dir):
    _put_rows(pid, ["d0", "d1", "d2"])
    assert tq.dump_data_by_key(dump_dir, ["d1", "d1", "d2"], pid)["keys"] == 2
    assert json.loads((dump_dir / fmt.MANIFEST).read_text())["keys"] == 2


def test_empty_key_set_writes_a_readable_dump(pid, dump_dir):
    report = tq.dump_data_by_key(dump_dir, [], pid + "-empty")
    assert (report["keys"], report["rows_with_data"]) == (0, 0)
    assert (dump_dir / fmt.MANIFEST).exists()
    assert tq.load_data_by_key(dump_dir)["keys"] == 0


def test_live_partition_survives_a_dump(pid, dump_dir):
    keys = [f"l{i}" for i in range(4)]
    _put_rows(pid, keys)
    before = tq.get_client().kv_retrieve_meta(keys, pid).global_indexes
    tq.dump_data_by_key(dump_dir, ["l1"], pid)
    assert tq.get_client().kv_retrieve_meta(keys, pid).global_indexes == before
    got = tq.kv_batch_get(keys=keys, partition_id=pid, select_fields=["input_ids"])
    _rows_equal(got["input_ids"], [_ids(i) for i in range(4)])


def test_row_index_describes_keys_without_reading_payload(pid, dump_dir):
    _put_rows(pid, ["i0", "i1"])
    tq.dump_data_by_key(dump_dir, ["i0", "i1"], pid)
    index = tq.read_row_index(dump_dir)
    assert index["partition_id"] == pid and sorted(index["rows"]) == ["i0", "i1"]
    for row, key in enumerate(["i0", "i1"]):
        assert index["rows"][key]["fields"] == ["attention_mask", "input_ids"]
        assert index["rows"][key]["tag"] == {"idx": row}
    with pytest.raises(FileNotFoundError):
        tq.read_row_index(dump_dir.parent / "missing")


def test_errors(pid, dump_dir):
    _put_rows(pid, ["e0"])
    with pytest.raises(RuntimeError, match="keys not found"):
        tq.dump_data_by_key(dump_dir, ["e0", "nope"], pid)
    assert not dump_dir.exists() and not list(dump_dir.parent.glob("dump.tmp*"))
    with pytest.raises(RuntimeError, match="does not exist"):
        tq.dump_data_by_key(dump_dir, ["e0"], pid + "-never-created")
    dump_dir.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="dump_info.json"):
        tq.load_data_by_key(dump_dir)
    shutil.rmtree(dump_dir)
    _put_rows(pid, ["m0", "m1"])
    tq.dump_data_by_key(dump_dir, ["m0", "m1"], pid)
    info = json.loads((dump_dir / fmt.MANIFEST).read_text())
    version = info["format_version"]
    info["format_version"] = 99
    (dump_dir / fmt.MANIFEST).write_text(json.dumps(info))
    with pytest.raises(ValueError, match="Unsupported dump format version"):
        tq.load_data_by_key(dump_dir)
    info["format_version"] = version
    (dump_dir / fmt.MANIFEST).write_text(json.dumps(info))
    next((dump_dir / fmt.SHARDS_DIR).glob("*.bin")).unlink()
    with pytest.raises(FileNotFoundError, match="shard file is missing"):
        tq.load_data_by_key(dump_dir, partition_id=pid + "-t")


def test_load_moves_no_payload_through_the_caller(pid, dump_dir, monkeypatch):
    keys = [f"key-{i}" for i in range(16)]
    _put_rows(pid, keys)
    tq.dump_data_by_key(dump_dir, keys, pid)
    real_open = builtins.open

    def no_shard_open(path, *a, **k):
        if Path(str(path)).parent.name == fmt.SHARDS_DIR:
            raise AssertionError("the caller opened a payload shard")
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", no_shard_open)
    client = tq.get_client()._client

    def no_put(*a, **k):
        raise AssertionError("the caller sent payload through a put")
    monkeypatch.setattr(client, "put_columns", no_put)
    tq.load_data_by_key(dump_dir, partition_id=pid + "-r")
    monkeypatch.undo()
    got = tq.kv_batch_get(keys, pid + "-r", select_fields=["input_ids"])
    _rows_equal(got["input_ids"], [_ids(i) for i in range(16)])


def test_incompatible_schema_rejected_before_writes(pid, dump_dir):
    tq.kv_batch_put(["k"], pid, TensorDict({"x": torch.tensor([[3]], dtype=torch.int64)}, 1))
    tq.dump_data_by_key(dump_dir, ["k"], pid)
    tq.get_client().clear_partition(pid)
    tq.kv_batch_put(["k"], pid, TensorDict({"x": torch.tensor([[1.5]])}, 1))
    with pytest.raises(RuntimeError, match="dtype mismatch"):
        tq.load_data_by_key(dump_dir)
    _rows_equal(tq.kv_batch_get(["k"], pid, ["x"])["x"], [torch.tensor([1.5])])


@pytest.mark.parametrize("tensor_first", [True, False])
def test_regular_put_keeps_legacy_tensor_nontensor_acceptance(pid, tensor_first):
    values = [torch.tensor([[7]]), NonTensorStack("text")]
    if not tensor_first:
        values.reverse()
    for key, value in zip(["first", "second"], values):
        tq.kv_batch_put([key], pid, TensorDict({"x": value}, batch_size=1))
    meta = tq.get_client().kv_retrieve_meta(["first", "second"], pid)
    assert meta.is_ready and meta.field_names == ["x"]
    assert tq.get_client().get_production_status(["x"], pid)[1].tolist() == [[1], [1]]
