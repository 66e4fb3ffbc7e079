"""TransferQueue 0.1.11's end-to-end KV tests (its wheel's ``tests/e2e/test_kv_interface_e2e.py``)
restated against tqtx with the default config: the same calls, sync and async, and the same
expectations. Where TransferQueue's test reads its controller actor's internals (key
mapping, custom meta, production status), this suite reads the same facts through public
calls (``kv_list``, ``get_client().kv_retrieve_meta`` / ``get_production_status``). Its Ray
worker test is run as a second process attaching with a bare ``tq.init()``."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq

# TransferQueue's own test config (polling mode: a fetch with too few samples returns at once)
TQ_CONFIG = {"controller": {"polling_mode": True},
             "backend": {"storage_backend": "SimpleStorage",
                         "SimpleStorage": {"total_storage_size": 200, "num_data_storage_units": 2}}}


@pytest.fixture(scope="module")
def tq_system(tmp_path_factory):
    tq.close()
    cfg = tq.init({**TQ_CONFIG, "state_dir": str(tmp_path_factory.mktemp("tq-kv-suite"))})
    yield cfg
    tq.close()


pytestmark = pytest.mark.usefixtures("tq_system")


class Calls:
    """``kv_*`` calls made directly or through their ``async_`` twins."""

    def __init__(self, use_async: bool):
        self.use_async = use_async

    def __getattr__(self, name):
        if self.use_async and name.startswith("kv_"):
            fn = getattr(tq, f"async_{name}")
            return lambda *a, **k: asyncio.run(fn(*a, **k))
        return getattr(tq, name)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def api(request):
    return Calls(request.param)


def _rows_of(col) -> list:
    if isinstance(col, list):
        return col
    return list(col.unbind()) if col.is_nested else list(col.unbind(0))


def same(got, want):
    """Equal rows, whether a column is nested (TransferQueue's shape) or dense."""
    a, b = _rows_of(got), _rows_of(want)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x, y)


def meta_of(keys, pid):
    return tq.get_client().kv_retrieve_meta(keys, pid)


def produced(keys, fields, pid) -> list[list[int]]:
    """Per key (in ``keys`` order), whether each of ``fields`` was produced."""
    idx, status = tq.get_client().get_production_status(fields, pid)
    row = dict(zip(idx.tolist(), status.tolist()))
    return [row[i] for i in meta_of(keys, pid).global_indexes]


# ---------------------------------------------------------------- kv_put
def test_kv_put_with_dict_fields(api, pid):
    api.kv_put(key="s0", partition_id=pid, fields={"data": torch.tensor([1, 2, 3, 4])},
               tag={"type": "dict_test"})
    same(api.kv_batch_get(keys="s0", partition_id=pid)["data"], torch.tensor([[1, 2, 3, 4]]))


def test_kv_put_with_tensordict_fields(api, pid):
    td = TensorDict({"input_ids": torch.tensor([[1, 2, 3, 4]])}, batch_size=1)
    api.kv_put(key="s1", partition_id=pid, fields=td, tag={"type": "tensordict_test"})
    same(api.kv_batch_get(keys="s1", partition_id=pid)["input_ids"], torch.tensor([[1, 2, 3, 4]]))


def test_kv_put_single_sample_with_fields_and_tag(api, pid):
    ids, mask = torch.tensor([1, 2, 3]), torch.ones(3)
    api.kv_put(key="s2", partition_id=pid, fields={"input_ids": ids, "attention_mask": mask},
               tag={"global_steps": 0, "status": "running"})
    assert api.kv_list(partition_id=pid)[pid]["s2"] == {"global_steps": 0, "status": "running"}
    meta = meta_of(["s2"], pid)
    assert meta.field_names == ["attention_mask", "input_ids"] and meta.is_ready
    assert produced(["s2"], ["input_ids"], pid) == [[1]]
    got = api.kv_batch_get(keys="s2", partition_id=pid)
    same(got["input_ids"], ids.unsqueeze(0))
    same(got["attention_mask"], mask.unsqueeze(0))


def test_kv_put_update_tag_only(api, pid):
    api.kv_put(key="s3", partition_id=pid,
               fields=TensorDict({"value": torch.tensor([[10]])}, batch_size=1), tag={"version": 1})
    api.kv_put(key="s3", partition_id=pid, fields=None, tag={"version": 2, "status": "updated"})
    assert api.kv_list(partition_id=pid)[pid]["s3"] == {"version": 2, "status": "updated"}
    same(api.kv_batch_get(keys="s3", partition_id=pid)["value"], torch.tensor([[10]]))


def test_kv_put_partial_update(api, pid):
    api.kv_put(key="s4", partition_id=pid,
               fields=TensorDict({"input_ids": torch.tensor([[1, 2, 3, 4]])}, 1), tag={"v": 1})
    api.kv_put(key="s4", partition_id=pid,
               fields=TensorDict({"response": torch.tensor([[5, 6]])}, 1), tag={"v": 2})
    assert produced(["s4"], ["response"], pid) == [[1]]


def test_kv_put_returns_cumulative_fields(api, pid):
    first = api.kv_put(key="c", partition_id=pid,
                       fields=TensorDict({"input_ids": torch.tensor([[1, 2, 3]])}, 1), tag={"s": 1})
    assert first.fields == ["input_ids"]
    second = api.kv_put(key="c", partition_id=pid,
                        fields=TensorDict({"attention_mask": torch.tensor([[1, 1, 1]])}, 1),
                        tag={"s": 2})
    assert sorted(second.fields) == ["attention_mask", "input_ids"]
    third = api.kv_put(key="c", partition_id=pid,
                       fields=TensorDict({"response": torch.tensor([[10, 20]])}, 1), tag={"s": 3})
    assert sorted(third.fields) == ["attention_mask", "input_ids", "response"]


# ---------------------------------------------------------------- kv_batch_put
def test_kv_batch_put_multiple_samples(api, pid):
    keys = ["b0", "b1", "b2", "b3"]
    ids = torch.tensor([[4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15]])
    api.kv_batch_put(keys=keys, partition_id=pid,
                     fields=TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                       batch_size=4),
                     tags=[{"idx": i, "batch": True} for i in range(4)])
    listed = api.kv_list(partition_id=pid)[pid]
    assert all(listed[k] == {"idx": i, "batch": True} for i, k in enumerate(keys))
    got = api.kv_batch_get(keys=keys, partition_id=pid)
    same(got["input_ids"], ids)
    same(got["attention_mask"], torch.ones_like(ids))


def test_kv_batch_put_partial_update(api, pid):
    keys = ["p0", "p1"]
    api.kv_batch_put(keys=keys, partition_id=pid,
                     fields=TensorDict({"input_ids": torch.tensor([[1, 2], [3, 4]])}, 2),
                     tags=[{"v": 1}, {"v": 1}])
    api.kv_batch_put(keys=["p1"], partition_id=pid,
                     fields=TensorDict({"response": torch.tensor([[5, 6]])}, 1), tags=[{"v": 2}])
    assert produced(keys, ["response"], pid) == [[0], [1]]


def test_kv_batch_put_returns_cumulative_fields(api, pid):
    keys = ["bc0", "bc1"]
    first = api.kv_batch_put(keys=keys, partition_id=pid, fields=TensorDict(
        {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}, 2), tags=[{"step": 1}] * 2)
    assert first.fields == ["input_ids"]
    second = api.kv_batch_put(keys=keys, partition_id=pid, fields=TensorDict(
        {"attention_mask": torch.ones(2, 3, dtype=torch.int64)}, 2), tags=[{"step": 2}] * 2)
    assert sorted(second.fields) == ["attention_mask", "input_ids"]
    assert second.tags == [{"step": 2}] * 2


def test_kv_batch_put_returns_every_keys_stored_tag(api, pid):
    # keys new, tagged before, and stored before without a tag, with and without tags now
    def put(keys, tags=None):
        return api.kv_batch_put(keys=keys, partition_id=pid, tags=tags, fields=TensorDict(
            {"x": torch.arange(len(keys))[:, None]}, len(keys))).tags
    assert put(["t0", "t1"], [{"a": 1}, {}]) == [{"a": 1}, {}]
    assert put(["t0", "t1", "t2"], [{"b": 2}, {"c": 3}, {"d": 4}]) == \
        [{"a": 1, "b": 2}, {"c": 3}, {"d": 4}]
    assert put(["t2", "t0", "t3"]) == [{"d": 4}, {"a": 1, "b": 2}, {}]
    assert put(["t3", "t1"], [{"e": 5}, None]) == [{"e": 5}, {"c": 3}]


# ---------------------------------------------------------------- kv_batch_get
def test_kv_batch_get_nested_tensor(api, pid):
    keys, rows = [], []
    for i in range(1, 4):
        keys.append(f"n{i}")
        rows.append(torch.randn(i))
        api.kv_put(key=keys[-1], partition_id=pid,
                   fields=TensorDict({"data": rows[-1].unsqueeze(0)}, batch_size=1), tag=None)
    got = api.kv_batch_get(keys=keys, partition_id=pid)["data"]
    same(got, torch.nested.as_nested_tensor(rows, layout=torch.jagged))


def test_kv_batch_get_single_and_multiple_keys(api, pid):
    api.kv_put(key="one", partition_id=pid,
               fields=TensorDict({"data": torch.tensor([[100, 200, 300]])}, 1), tag=None)
    same(api.kv_batch_get(keys="one", partition_id=pid)["data"], torch.tensor([[100, 200, 300]]))
    keys = ["m0", "m1", "m2"]
    want = torch.tensor([[1, 2], [3, 4], [5, 6]])
    api.kv_batch_put(keys=keys, partition_id=pid, fields=TensorDict({"data": want}, 3),
                     tags=[{}, {}, {}])
    same(api.kv_batch_get(keys=keys, partition_id=pid)["data"], want)


def test_kv_batch_get_partial_keys(api, pid):
    keys = ["q3", "q4", "q5"]
    nested = torch.nested.nested_tensor([[10, 11, 12], [20], [30, 31]])
    three = torch.nested.nested_tensor([[[10, 11], [12, 13]], [[20, 21], [22, 23]],
                                        [[30, 31], [32, 33]]])
    api.kv_batch_put(keys=keys, partition_id=pid, fields=TensorDict(
        {"data": torch.tensor([[1, 2], [3, 4], [5, 6]]), "nested_data": nested,
         "three_d_nested_data": three}, batch_size=3), tags=[{}, {}, {}])
    got = api.kv_batch_get(keys=["q3", "q5"], partition_id=pid)
    same(got["data"], torch.tensor([[1, 2], [5, 6]]))
    same(got["nested_data"], [torch.tensor([10, 11, 12]), torch.tensor([30, 31])])
    same(got["three_d_nested_data"], [torch.tensor([[10, 11], [12, 13]]),
                                      torch.tensor([[30, 31], [32, 33]])])


def test_kv_batch_get_partial_fields(api, pid):
    ids, mask, resp = torch.tensor([[1, 2, 3]]), torch.ones(1, 3), torch.tensor([[10, 20]])
    api.kv_put(key="f", partition_id=pid, fields=TensorDict(
        {"input_ids": ids, "attention_mask": mask, "response": resp}, 1), tag=None)
    got = api.kv_batch_get(keys="f", partition_id=pid, select_fields="input_ids")
    assert list(got.keys()) == ["input_ids"]
    same(got["input_ids"], ids)
    got = api.kv_batch_get(keys="f", partition_id=pid, select_fields=["input_ids", "response"])
    assert sorted(got.keys()) == ["input_ids", "response"]
    same(got["response"], resp)


def test_kv_batch_get_nonexistent_key(api, pid):
    with pytest.raises(ValueError, match="not found"):
        api.kv_batch_get(keys="nonexistent_key", partition_id=pid)


# ---------------------------------------------------------------- kv_batch_get_by_meta
def test_kv_batch_get_by_meta(api, pid):
    keys = ["g0", "g1", "g2"]
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    resp = torch.tensor([[10, 20], [30, 40], [50, 60]])
    meta = api.kv_batch_put(keys=keys, partition_id=pid, fields=TensorDict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response": resp}, 3),
        tags=[{"idx": i} for i in range(3)])
    assert sorted(meta.fields) == ["attention_mask", "input_ids", "response"]
    got = api.kv_batch_get_by_meta(meta, select_fields="input_ids")
    assert list(got.keys()) == ["input_ids"]
    same(got["input_ids"], ids)
    got = api.kv_batch_get_by_meta(meta, select_fields=["attention_mask", "response"])
    assert sorted(got.keys()) == ["attention_mask", "response"]
    same(got["response"], resp)
    assert sorted(api.kv_batch_get_by_meta(meta).keys()) == sorted(meta.fields)
    with pytest.raises(ValueError, match=r"select_fields.*not found"):
        api.kv_batch_get_by_meta(meta, select_fields="nonexistent_field")
    with pytest.raises(ValueError, match=r"select_fields.*not found"):
        api.kv_batch_get_by_meta(meta, select_fields=["input_ids", "invalid_field"])


def test_kv_batch_get_by_meta_multiple_puts(api, pid):
    keys = ["mm0", "mm1"]
    api.kv_batch_put(keys=keys, partition_id=pid, fields=TensorDict(
        {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}, 2), tags=[{}, {}])
    second = api.kv_batch_put(keys=keys, partition_id=pid, fields=TensorDict(
        {"attention_mask": torch.tensor([[1, 1, 1], [1, 1, 1]])}, 2), tags=[{}, {}])
    got = api.kv_batch_get_by_meta(second)
    same(got["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    same(got["attention_mask"], torch.tensor([[1, 1, 1], [1, 1, 1]]))


# ---------------------------------------------------------------- kv_list
def test_kv_list(api, pid):
    for i, k in enumerate(["l0", "l1", "l2"]):
        api.kv_put(key=k, partition_id=pid, fields={"data": torch.tensor([[i]])}, tag={"id": i})
    info = api.kv_list(partition_id=pid)
    assert list(info) == [pid] and [t["id"] for t in info[pid].values()] == [0, 1, 2]
    other = pid + "-b"
    api.kv_batch_put(keys=["l0", "l1"], partition_id=other,  # the same keys, another partition
                     fields=TensorDict({"data": torch.tensor([[3], [4]])}, 2),
                     tags=[{"id": 3}, {"id": 4}])
    every = api.kv_list()
    assert [t["id"] for t in every[pid].values()] == [0, 1, 2]
    assert [t["id"] for t in every[other].values()] == [3, 4]
    assert api.kv_list(partition_id=pid + "-empty") == {}


# ---------------------------------------------------------------- kv_clear
def test_kv_clear(api, pid):
    keys = [f"x{i}" for i in range(4)]
    api.kv_batch_put(keys=keys, partition_id=pid,
                     fields=TensorDict({"data": torch.tensor([[0], [1], [2], [3]])}, 4),
                     tags=[{}] * 4)
    api.kv_clear(keys="x0", partition_id=pid)
    assert sorted(api.kv_list(partition_id=pid)[pid]) == keys[1:]
    api.kv_clear(keys=["nonexistent_1", "x1"], partition_id=pid)  # unknown ones are ignored
    assert sorted(api.kv_list(partition_id=pid)[pid]) == keys[2:]
    api.kv_clear(keys=["x1"], partition_id=pid)  # idempotent
    api.kv_clear(keys=["any"], partition_id=pid + "-nonexistent")
    assert sorted(api.kv_list(partition_id=pid)[pid]) == keys[2:]


def test_kv_clear_does_not_leak_reused_index_across_partitions(api, pid):
    p1, p2 = pid + "-1", pid + "-2"
    api.kv_put(key="a", partition_id=p1, fields={"x": torch.tensor([1])})
    api.kv_clear(keys="a", partition_id=p1)
    api.kv_put(key="b", partition_id=p2, fields={"x": torch.tensor([2])})
    leaked = tq.get_client().get_meta(data_fields=["x"], batch_size=1, partition_id=p1,
                                      mode="fetch", task_name="reuse",
                                      sampling_config=None)
    assert leaked.size == 0 and leaked.global_indexes == [] and not leaked.is_ready


def test_field_expansion_across_samples(api, pid):
    api.kv_put(key="e0", partition_id=pid, fields={"field_a": torch.tensor([[1]])}, tag=None)
    api.kv_put(key="e0", partition_id=pid, fields={"field_b": torch.tensor([[2]])}, tag=None)
    api.kv_put(key="e1", partition_id=pid, fields={"field_a": torch.tensor([[3]]),
                                                   "field_c": torch.tensor([[4]])}, tag=None)
    data = api.kv_batch_get(keys=["e0", "e1"], partition_id=pid)
    assert list(data.keys()) == ["field_a"]  # the only field both keys have


@pytest.mark.slow
def test_kv_api_in_another_process(tq_system, pid):
    """TransferQueue's Ray-worker test: a second process attaches with a bare tq.init()."""
    code = textwrap.dedent("""
        import asyncio, json, sys, torch, tqtx as tq
        tq.init()
        pid, key, use_async = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
        def call(name, *a, **k):
            fn = getattr(tq, f"async_{name}" if use_async else name)
            return asyncio.run(fn(*a, **k)) if use_async else fn(*a, **k)
        meta = call("kv_put", key=key, partition_id=pid, fields={"data": torch.tensor([1, 2, 3])},
                    tag={"source": "worker"})
        data = call("kv_batch_get", keys=key, partition_id=pid)
        before = call("kv_list", partition_id=pid)
        call("kv_clear", keys=key, partition_id=pid)
        after = call("kv_list", partition_id=pid)
        print(json.dumps({"fields": meta.fields, "data": list(data["data"])[0].tolist(),
                          "before": key in before.get(pid, {}),
                          "after": key in after.get(pid, {})}))
    """)
    env = {**os.environ, "TQTX_STATE_DIR": tq_system["state_dir"]}
    env.pop("TQTX_ADDRESS", None)
    for flag in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", code, pid, f"w{flag}", flag], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {
            "fields": ["data"], "data": [1, 2, 3], "before": True, "after": False}


# ---------------------------------------------------------------- result shapes (tqtx)
def test_uniform_rows_come_back_jagged_as_a_view_without_copy(pid):
    x = torch.arange(6 * 4096, dtype=torch.float32).reshape(6, 4096)
    tq.kv_batch_put([f"k{i}" for i in range(6)], pid, TensorDict({"x": x, "r": x[:, 0]}, [6]))
    got = tq.kv_batch_get([f"k{i}" for i in range(6)], pid)
    col = got["x"]
    assert col.is_nested and col.layout == torch.jagged and col.offsets().tolist() == \
        list(range(0, 7 * 4096, 4096))
    assert col.to_padded_tensor(0.0).shape == (6, 4096)  # it knows its longest row
    assert torch.equal(col.values().view(6, 4096), x)
    assert not got["r"].is_nested and torch.equal(got["r"], x[:, 0])  # 0-d rows stay dense
    assert list(got.keys()) == ["r", "x"]  # in name order, as TransferQueue returns them
