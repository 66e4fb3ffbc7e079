"""TransferQueue's low-level client on tqtx (``tq.get_client()``): BatchMeta by key and by
index, put / get_data with a BatchMeta, streaming get_meta with per-task consumption,
production status, clears. The calls verl's workers and NeMo-RL's adapter make."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tqtx as tq
from tqtx.compat import dataplane

pytestmark = pytest.mark.usefixtures("tq_shared")


def _put(pid, keys, base=0, tags=None):
    n = len(keys)
    x = torch.nested.as_nested_tensor([torch.arange(base + i, base + 2 * i + 1) for i in range(n)],
                                      layout=torch.jagged)
    return tq.kv_batch_put(keys, pid, TensorDict({"x": x, "r": torch.arange(n) + base}, [n]),
                           tags=tags or [{"i": i} for i in range(n)])


def _rows(col):
    return [t.tolist() for t in col.unbind()]


def test_kv_retrieve_meta_and_keys(pid, caplog):
    client = tq.get_client()
    _put(pid, ["a", "b", "c"])
    meta = client.kv_retrieve_meta(["c", "zz", "a"], pid)
    assert isinstance(meta, tq.BatchMeta) and meta.size == 2  # unknown keys are left out
    assert "'zz'" in caplog.text
    assert meta.sample_keys == ["c", "a"] and meta.custom_meta == [{"i": 2}, {"i": 0}]
    assert meta.field_names == ["r", "x"] and meta.is_ready
    assert meta.field_schema["x"]["dtype"] == torch.int64
    assert client.kv_retrieve_keys(meta.global_indexes, pid) == ["c", "a"]
    assert client.kv_retrieve_keys(meta.global_indexes[0], pid) == ["c"]
    with pytest.raises(RuntimeError, match="no corresponding keys"):
        client.kv_retrieve_keys([meta.global_indexes[0], 10**9], pid)
    with pytest.raises(ValueError):
        client.kv_retrieve_keys([], pid)
    with pytest.raises(TypeError):
        client.kv_retrieve_keys(["0"], pid)
    with pytest.raises(TypeError):
        client.kv_retrieve_meta(("a",), pid)
    assert client.kv_retrieve_meta("zz", pid + "-none").size == 0
    made = client.kv_retrieve_meta(["a", "new"], pid, create=True)  # "new" is made, no fields
    assert made.sample_keys == ["a", "new"] and made.field_names == [] and not made.is_ready
    assert tq.kv_list(pid)[pid]["new"] == {}


def test_put_and_get_data_with_a_batchmeta(pid):
    client = tq.get_client()
    _put(pid, ["a", "b", "c"])
    meta = client.kv_retrieve_meta(["b", "c"], pid)
    got = client.get_data(meta)
    assert list(got.keys()) == ["r", "x"] and _rows(got["x"]) == [[1, 2], [2, 3, 4]]
    meta.update_custom_meta([{"seen": True}, {}])
    out = TensorDict({"y": torch.ones(2, 3), "s": NonTensorStack("p", "q")}, [2])
    same = client.put(out, metadata=meta)
    assert same is meta and same.field_names == ["r", "s", "x", "y"]
    assert tq.kv_list(pid)[pid]["b"] == {"i": 1, "seen": True}  # tags merged
    back = client.get_data(meta.select_fields(["y", "s"]))
    assert list(back.keys()) == ["s", "y"] and back["s"].tolist() == ["p", "q"]
    assert _rows(back["y"]) == [[1.0] * 3] * 2  # TransferQueue's shape: jagged
    # a BatchMeta built from indexes only: its keys are looked up
    bare = tq.BatchMeta(meta.global_indexes, meta.partition_ids, meta.field_schema)
    assert bare.sample_keys is None
    assert _rows(client.get_data(bare.select_fields(["x"]))["x"]) == [[1, 2], [2, 3, 4]]
    assert client.get_data(tq.BatchMeta.empty()).batch_size == torch.Size([0])
    with pytest.raises(NotImplementedError, match="insert mode"):
        client.put(out, partition_id=pid)
    with pytest.raises(ValueError, match="empty"):
        client.put(out, metadata=tq.BatchMeta.empty())
    with pytest.raises(NotImplementedError, match="data_parser"):
        client.put(out, metadata=meta, data_parser=dict)


def test_get_meta_fetch_consumes_in_index_order(pid):
    client = tq.get_client()
    _put(pid, [f"k{i}" for i in range(5)])
    tq.kv_put("nox", pid, tag={"only": "tag"})  # no field x: never ready for it
    first = client.get_meta(["x"], 2, pid, task_name="train")
    assert first.sample_keys == ["k0", "k1"] and first.is_ready
    assert first.custom_meta == [{"i": 0}, {"i": 1}] and first.field_names == ["x"]
    second = client.get_meta(["x"], 2, pid, task_name="train", sampling_config={"dp_rank": 0})
    assert second.sample_keys == ["k2", "k3"]
    assert client.get_meta(["x"], 2, pid, task_name="other").sample_keys == ["k0", "k1"]
    assert not client.check_consumption_status("train", pid)
    idx, done = client.get_consumption_status("train", pid)
    assert done.tolist() == [1, 1, 1, 1, 0, 0]  # k0..k4 and nox, by index
    dataplane_timeout = dataplane.GET_META_TIMEOUT
    dataplane.GET_META_TIMEOUT = 0.3
    try:
        with pytest.raises(TimeoutError, match="Required: 2, Available: 1"):
            client.get_meta(["x"], 2, pid, task_name="train")
    finally:
        dataplane.GET_META_TIMEOUT = dataplane_timeout
    assert client.get_meta(["x"], 1, pid, task_name="train").sample_keys == ["k4"]
    assert not client.check_consumption_status("train", pid)  # "nox" is never consumed
    everything = client.get_meta(["x"], 1, pid, mode="force_fetch")
    assert everything.sample_keys == ["k0", "k1", "k2", "k3", "k4", "nox"]
    assert everything.production_status.tolist() == [1, 1, 1, 1, 1, 0]
    assert client.get_meta([], 6, pid, task_name="tags").size == 6  # no field asked: all
    assert client.check_consumption_status("tags", pid)
    assert client.reset_consumption(pid, "train")
    assert client.get_meta(["x"], 1, pid, task_name="train").sample_keys == ["k0"]
    with pytest.raises(NotImplementedError, match="insert mode"):
        client.get_meta(["x"], 1, pid, mode="insert")
    with pytest.raises(ValueError, match="task_name"):
        client.get_meta(["x"], 1, pid)
    assert client.get_meta(["x"], 1, pid + "-none", task_name="t", mode="force_fetch").size == 0


def test_fetch_waits_for_samples_put_meanwhile(pid):
    client = tq.get_client()
    got = {}

    def fetch():
        got["meta"] = client.get_meta(["x"], 2, pid, task_name="later")
    t = threading.Thread(target=fetch)
    t.start()
    _put(pid, ["a", "b"])
    t.join(30)
    assert got["meta"].sample_keys == ["a", "b"]


def test_cleared_samples_are_not_consumed_when_put_again(pid):
    client = tq.get_client()
    _put(pid, ["a", "b"])
    assert client.get_meta(["x"], 2, pid, task_name="t").size == 2
    assert client.check_consumption_status("t", pid)
    client.clear_samples(client.kv_retrieve_meta(["a"], pid))
    assert sorted(tq.kv_list(pid)[pid]) == ["b"]
    _put(pid, ["a"], base=7)  # the same key again (it may get the same index back)
    assert client.get_meta(["x"], 1, pid, task_name="t").sample_keys == ["a"]
    assert pid in client.get_partition_list()
    client.clear_partition(pid)
    assert tq.kv_list(pid) == {} and pid not in client.get_partition_list()
    assert client.get_consumption_status("t", pid) == (None, None)


def test_production_status_per_field(pid):
    client = tq.get_client()
    _put(pid, ["a", "b"])
    tq.kv_put("a", pid, {"y": torch.ones(2)})
    idx, status = client.get_production_status(["x", "y"], pid)
    assert status.tolist() == [[1, 1], [1, 0]] and len(idx) == 2
    assert client.check_production_status(["x"], pid)
    assert not client.check_production_status(["x", "y"], pid)
    assert client.get_production_status(["never"], pid) == (None, None)
    assert not client.check_production_status(["never"], pid)


def test_a_field_may_take_tensor_and_non_tensor_values_across_puts(pid):
    """The seed PR's rule for regular puts (TransferQueue accepts both, in either order)."""
    client = tq.get_client()
    for first, second, part in [(torch.tensor([[7]]), NonTensorStack("text"), "tf"),
                                (NonTensorStack("text"), torch.tensor([[7]]), "nf")]:
        p = f"{pid}-{part}"
        tq.kv_batch_put(["first"], p, TensorDict({"x": first}, [1]))
        tq.kv_batch_put(["second"], p, TensorDict({"x": second}, [1]))
        meta = client.kv_retrieve_meta(["first", "second"], p)
        assert meta.is_ready and meta.field_names == ["x"]
        col = tq.kv_batch_get(["first", "second"], p)["x"]
        values = col.tolist()
        assert isinstance(col, list)  # TransferQueue's NonTensorStack of what was put
        assert {type(v) for v in values} == {torch.Tensor, str}


@pytest.mark.strict
def test_strict_mode_keeps_a_fields_kind(pid):
    tq.kv_batch_put(["first"], pid, TensorDict({"x": torch.tensor([[7]])}, [1]))
    with pytest.raises(tq.SchemaConflictError, match="dtype mismatch"):
        tq.kv_batch_put(["second"], pid, TensorDict({"x": NonTensorStack("text")}, [1]))


def test_async_forms(pid):
    client = tq.get_client()
    _put(pid, ["a", "b"])

    async def run():
        meta = await client.async_kv_retrieve_meta(keys=["a", "b"], partition_id=pid)
        keys = await client.async_kv_retrieve_keys(global_indexes=meta.global_indexes,
                                                   partition_id=pid)
        data = await client.async_get_data(meta)
        meta = await client.async_put(data=TensorDict({"z": torch.ones(2)}, [2]), metadata=meta)
        fetched = await client.async_get_meta(data_fields=["z"], batch_size=2, partition_id=pid,
                                              task_name="t")
        done = await client.async_check_consumption_status(task_name="t", partition_id=pid)
        return keys, data, meta, fetched, done
    keys, data, meta, fetched, done = asyncio.run(run())
    assert keys == ["a", "b"] and _rows(data["x"]) == [[0], [1, 2]]
    assert "z" in meta.field_names and fetched.sample_keys == ["a", "b"] and done


def test_polling_mode_from_transferqueues_config(tq_start, pid):
    tq_start(2, controller={"polling_mode": True})
    client = tq.get_client()
    _put(pid, ["a"])
    assert client.get_meta(["x"], 2, pid, task_name="t").size == 0  # at once, empty
    assert client.get_meta(["x"], 1, pid, task_name="t").sample_keys == ["a"]
