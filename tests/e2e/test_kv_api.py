"""End-to-end KV API against a real deployment (controller + 3 units as child processes),
in tqtx's strict mode (strict keys, dense results; the default, TransferQueue's semantics,
is covered by tests/e2e/test_tq_kv_suite.py).

All tests share the module-scoped ``tq_shared`` deployment and use their own partition.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tqtx as tq
from tqtx import KeysNotFoundError

pytestmark = [pytest.mark.usefixtures("tq_shared"), pytest.mark.strict]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
          torch.uint8]


def indexes(pid, keys):
    """Global indexes of ``keys`` (controller LOOKUP)."""
    return tq.get_client().controller.call(
        "LOOKUP", {"partition_id": pid, "keys": keys, "select_fields": None})["indexes"]


def unit_stats():
    return tq.get_client().stats()["units"]


def _sample(dtype, shape):
    n = 1
    for s in shape:
        n *= s
    x = torch.arange(n).reshape(shape)
    return (x % 3 == 0) if dtype == torch.bool else x.to(dtype)


# ---------------------------------------------------------------- basics
def test_kv_put_and_get_single(pid):
    meta = tq.kv_put("k0", pid, {"obs": torch.arange(4), "txt": "hello"}, tag={"step": 1})
    assert meta.keys == ["k0"] and meta.partition_id == pid
    assert sorted(meta.fields) == ["obs", "txt"]
    assert meta.tags == [{"step": 1}]
    td = tq.kv_batch_get(["k0"], pid)
    assert td.batch_size == torch.Size([1])
    assert torch.equal(td["obs"], torch.arange(4).unsqueeze(0))
    assert isinstance(td.get("txt"), NonTensorStack) and td.get("txt").tolist() == ["hello"]
    assert tq.kv_list(pid) == {pid: {"k0": {"step": 1}}}


def test_kv_put_accepts_tensordict_row(pid):
    row = TensorDict({"x": torch.ones(1, 3)}, batch_size=[1])
    tq.kv_put("a", pid, row)
    assert torch.equal(tq.kv_batch_get(["a"], pid)["x"], torch.ones(1, 3))
    with pytest.raises(ValueError, match="one sample"):
        tq.kv_put("b", pid, TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]))
    assert list(tq.kv_list(pid)[pid]) == ["a"]


def test_kv_put_without_fields_creates_key_with_tag(pid):
    meta = tq.kv_put("empty", pid, tag={"status": "pending"})
    assert meta.fields == []
    assert tq.kv_list(pid) == {pid: {"empty": {"status": "pending"}}}
    td = tq.kv_batch_get(["empty"], pid)
    assert td.batch_size == torch.Size([1]) and list(td.keys()) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_round_trip(pid, dtype):
    keys = [f"k{i}" for i in range(5)]
    x = _sample(dtype, (5, 3, 2))
    s = _sample(dtype, (5,))
    tq.kv_batch_put(keys, pid, TensorDict({"x": x, "s": s}, batch_size=[5]))
    td = tq.kv_batch_get(keys, pid)
    assert td["x"].dtype == dtype and torch.equal(td["x"], x)
    assert td["s"].shape == (5,) and torch.equal(td["s"], s)
    # reversed request order and a subset
    td2 = tq.kv_batch_get(keys[::-2], pid, select_fields=["x"])
    assert list(td2.keys()) == ["x"]
    assert torch.equal(td2["x"], x.flip(0)[::2])


def test_scalar_zero_length_and_multidim_rows(pid):
    keys = ["a", "b", "c"]
    td = TensorDict({"scalar": torch.tensor([1.0, 2.0, 3.0]),
                     "empty": torch.zeros(3, 0, dtype=torch.int64),
                     "cube": torch.arange(3 * 2 * 3 * 4, dtype=torch.float16).reshape(3, 2, 3, 4)},
                    batch_size=[3])
    tq.kv_batch_put(keys, pid, td)
    out = tq.kv_batch_get(keys, pid)
    assert out["scalar"].shape == (3,) and out["scalar"].tolist() == [1.0, 2.0, 3.0]
    assert out["empty"].shape == (3, 0) and out["empty"].dtype == torch.int64
    assert torch.equal(out["cube"], td["cube"])
    # a single scalar row via kv_put
    tq.kv_put("d", pid, {"scalar": torch.tensor(4.0)})
    assert tq.kv_batch_get(["d"], pid, "scalar")["scalar"].tolist() == [4.0]


def test_non_contiguous_inputs(pid):
    base = torch.arange(200, dtype=torch.int32).reshape(10, 20)
    x = base[1:9:2, ::3]  # strided view with storage offset
    y = torch.arange(12.).reshape(3, 4).t()  # transposed, 4 rows
    assert not x.is_contiguous() and not y.is_contiguous()
    keys = [f"k{i}" for i in range(4)]
    tq.kv_batch_put(keys, pid, TensorDict({"x": x, "y": y}, batch_size=[4]))
    out = tq.kv_batch_get(keys, pid)
    assert torch.equal(out["x"], x) and torch.equal(out["y"], y)
    z = torch.arange(30.).reshape(5, 6)[:, 1::2]
    tq.kv_put("single", pid, {"z": z})
    assert torch.equal(tq.kv_batch_get(["single"], pid)["z"][0], z)


def test_jagged_nested_put_and_get(pid):
    rows = [torch.arange(3.), torch.arange(1.), torch.arange(0.), torch.arange(5.)]
    nt = torch.nested.nested_tensor(rows, layout=torch.jagged)
    keys = ["a", "b", "c", "d"]
    meta = tq.kv_batch_put(keys, pid, TensorDict({"resp": nt}, batch_size=[4]))
    assert meta.fields == ["resp"]
    out = tq.kv_batch_get(keys, pid)["resp"]
    assert out.is_nested
    assert [t.tolist() for t in out.unbind()] == [t.tolist() for t in rows]
    # a subset whose rows all have the same shape comes back dense
    tq.kv_batch_put(["e"], pid, TensorDict({"resp": torch.nested.nested_tensor(
        [torch.arange(3.) + 10], layout=torch.jagged)}, batch_size=[1]))
    dense = tq.kv_batch_get(["a", "e"], pid)["resp"]
    assert not dense.is_nested and dense.tolist() == [[0., 1., 2.], [10., 11., 12.]]


def test_rows_of_different_shapes_from_separate_puts_come_back_jagged(pid):
    tq.kv_put("a", pid, {"x": torch.arange(2)})
    tq.kv_put("b", pid, {"x": torch.arange(4)})
    out = tq.kv_batch_get(["b", "a"], pid)["x"]
    assert out.is_nested and [t.tolist() for t in out.unbind()] == [[0, 1, 2, 3], [0, 1]]


def test_non_tensor_stack_columns(pid):
    vals = ["s", {"nested": torch.arange(2), "l": [1, None]}, None, b"raw", 3.5]
    keys = [f"k{i}" for i in range(5)]
    td = TensorDict({"obj": NonTensorStack(*vals), "n": torch.arange(5)}, batch_size=[5])
    tq.kv_batch_put(keys, pid, td)
    out = tq.kv_batch_get(keys[::-1], pid)
    got = out.get("obj")
    assert isinstance(got, NonTensorStack)
    got = got.tolist()[::-1]
    assert got[0] == "s" and got[2] is None and got[3] == b"raw" and got[4] == 3.5
    assert torch.equal(got[1]["nested"], torch.arange(2)) and got[1]["l"] == [1, None]
    assert out["n"].tolist() == [4, 3, 2, 1, 0]


def test_batch_put_accepts_plain_dict(pid):
    tq.kv_batch_put(["a", "b"], pid, {"x": torch.ones(2, 2)})
    assert torch.equal(tq.kv_batch_get(["a", "b"], pid)["x"], torch.ones(2, 2))


# ---------------------------------------------------------------- overwrite, columns, tags
def test_overwrite_existing_field(pid):
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]))
    tq.kv_put("a", pid, {"x": torch.ones(3)})
    out = tq.kv_batch_get(["a", "b"], pid)["x"]
    assert out.tolist() == [[1.0] * 3, [0.0] * 3]
    # overwrite with another row shape of the same ndim: fine, comes back jagged
    tq.kv_put("b", pid, {"x": torch.ones(5)})
    out = tq.kv_batch_get(["a", "b"], pid)["x"]
    assert out.is_nested and [len(t) for t in out.unbind()] == [3, 5]


def test_new_field_adds_column_and_meta_fields_cumulative(pid):
    m1 = tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.ones(2)}, batch_size=[2]))
    assert m1.fields == ["x"]
    m2 = tq.kv_batch_put(["a", "b"], pid, TensorDict({"y": torch.zeros(2, 2)}, batch_size=[2]))
    assert sorted(m2.fields) == ["x", "y"]
    m3 = tq.kv_put("a", pid, {"z": "text"})
    assert sorted(m3.fields) == ["x", "y", "z"]
    out = tq.kv_batch_get(["a", "b"], pid)  # common fields only
    assert sorted(out.keys()) == ["x", "y"]
    out_a = tq.kv_batch_get(["a"], pid)
    assert sorted(out_a.keys()) == ["x", "y", "z"]
    assert out_a.get("z").tolist() == ["text"]
    with pytest.raises(KeyError, match="not produced"):
        tq.kv_batch_get(["a", "b"], pid, select_fields=["z"])


def test_tags_shallow_merged(pid):
    tq.kv_put("a", pid, {"x": torch.ones(1)}, tag={"status": "new", "cfg": {"a": 1}})
    tq.kv_put("a", pid, {"x": torch.ones(1)}, tag={"status": "done", "cfg": {"b": 2}, "n": 3})
    assert tq.kv_list(pid)[pid]["a"] == {"status": "done", "cfg": {"b": 2}, "n": 3}
    tq.kv_put("a", pid, {"y": torch.ones(1)})  # no tag: unchanged
    assert tq.kv_list(pid)[pid]["a"] == {"status": "done", "cfg": {"b": 2}, "n": 3}
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.ones(2, 1)}, batch_size=[2]),
                    tags=[{"extra": True}, None])
    listed = tq.kv_list(pid)[pid]
    assert listed["a"] == {"status": "done", "cfg": {"b": 2}, "n": 3, "extra": True}
    assert listed["b"] == {}


def test_tag_with_tensor_value(pid):
    tq.kv_put("a", pid, {"x": torch.ones(1)}, tag={"mask": torch.tensor([True, False])})
    tag = tq.kv_list(pid)[pid]["a"]
    assert torch.equal(tag["mask"], torch.tensor([True, False]))


# ---------------------------------------------------------------- get semantics
def test_get_unknown_keys(pid):
    tq.kv_put("a", pid, {"x": torch.ones(1)})
    with pytest.raises(KeysNotFoundError) as ei:
        tq.kv_batch_get(["a", "missing1", "missing2"], pid)
    assert isinstance(ei.value, KeyError) and isinstance(ei.value, ValueError)
    assert "not found" in str(ei.value)
    assert "missing1" in str(ei.value) and "missing2" in str(ei.value)
    assert ei.value.keys == ["missing1", "missing2"]
    with pytest.raises(KeysNotFoundError, match="not found"):
        tq.kv_batch_get(["a"], pid + "-nope")


def test_get_by_meta(pid):
    meta = tq.kv_batch_put(["a", "b"], pid, TensorDict(
        {"x": torch.arange(2), "s": NonTensorStack("p", "q")}, batch_size=[2]))
    tq.kv_put("a", pid, {"extra": torch.ones(1)})
    td = tq.kv_batch_get_by_meta(meta)
    assert sorted(td.keys()) == ["s", "x"]
    assert td["x"].tolist() == [0, 1] and td.get("s").tolist() == ["p", "q"]
    td2 = tq.kv_batch_get_by_meta(meta, select_fields=["x"])
    assert list(td2.keys()) == ["x"]


def test_get_select_single_field_str(pid):
    tq.kv_batch_put(["a"], pid, TensorDict({"x": torch.ones(1), "y": torch.zeros(1)}, [1]))
    assert list(tq.kv_batch_get(["a"], pid, select_fields="y").keys()) == ["y"]


def test_many_keys_spread_over_units(pid):
    n = 257
    keys = [f"key-{i}" for i in range(n)]
    x = torch.arange(n * 4, dtype=torch.int64).reshape(n, 4)
    tq.kv_batch_put(keys, pid, TensorDict({"x": x}, batch_size=[n]))
    owners = {i % 3 for i in indexes(pid, keys)}
    assert owners == {0, 1, 2}
    perm = torch.randperm(n).tolist()
    out = tq.kv_batch_get([keys[i] for i in perm], pid)
    assert torch.equal(out["x"], x[perm])


# ---------------------------------------------------------------- list / clear
def test_kv_list_all_and_one(pid):
    tq.kv_put("a", pid, tag={"t": 1})
    tq.kv_put("b", pid + "x", tag={"t": 2})
    everything = tq.kv_list()
    assert everything[pid] == {"a": {"t": 1}} and everything[pid + "x"] == {"b": {"t": 2}}
    assert tq.kv_list(pid + "x") == {pid + "x": {"b": {"t": 2}}}
    assert tq.kv_list(pid + "-unknown") == {}
    tq.kv_clear(["b"], pid + "x")


def test_kv_list_gives_each_key_its_own_tag_when_keys_share_equal_tags(pid):
    keys = ["a", "b", "c", "d"]
    tq.kv_batch_put(keys, pid, TensorDict({"x": torch.ones(4)}, batch_size=[4]),
                    tags=[{"step": 1}, {"step": 1}, {"v": [1, {"w": 2}], "t": torch.arange(2)},
                          {"v": [1, {"w": 2}], "t": torch.arange(2)}])
    listed = tq.kv_list(pid)[pid]
    assert list(listed) == keys
    assert listed["a"] == listed["b"] == {"step": 1}
    listed["a"]["step"] = 7
    listed["c"]["v"][1]["w"] = 9
    listed["c"]["t"] += 5
    assert listed["b"] == {"step": 1}
    assert listed["d"]["v"] == [1, {"w": 2}] and torch.equal(listed["d"]["t"], torch.arange(2))
    # the listing also works as the plain mapping, without the columnar flag
    raw = tq.get_client().controller.call("LIST", {"partition_id": pid})
    assert list(raw[pid]) == keys and raw[pid]["a"] == {"step": 1}
    tq.kv_clear(keys, pid)


def test_kv_clear_idempotent(pid):
    tq.kv_batch_put(["a", "b", "c"], pid, TensorDict({"x": torch.ones(3)}, batch_size=[3]))
    tq.kv_clear(["a", "nope"], pid)
    assert sorted(tq.kv_list(pid)[pid]) == ["b", "c"]
    tq.kv_clear(["a"], pid)
    tq.kv_clear(["x"], pid + "-unknown")
    with pytest.raises(ValueError, match="kv_clear.*keys.*empty list"):
        tq.kv_clear([], pid)  # as in TransferQueue
    tq.kv_clear("b", pid)
    assert list(tq.kv_list(pid)[pid]) == ["c"]
    with pytest.raises(KeysNotFoundError):
        tq.kv_batch_get(["a"], pid)
    tq.kv_clear(["c"], pid)
    assert tq.kv_list(pid) == {}


def test_freed_indexes_reused(pid, no_lease):
    keys = [f"k{i}" for i in range(6)]
    tq.kv_batch_put(keys, pid, TensorDict({"x": torch.ones(6)}, batch_size=[6]))
    old = indexes(pid, keys[:3])
    tq.kv_clear(keys[:3], pid)
    tq.kv_batch_put(["n0", "n1", "n2"], pid, TensorDict({"x": torch.zeros(3)}, batch_size=[3]))
    assert sorted(indexes(pid, ["n0", "n1", "n2"])) == sorted(old)
    assert tq.kv_batch_get(["n0", "n1", "n2", "k3"], pid)["x"].tolist() == [0, 0, 0, 1]


def test_reused_index_across_partitions_does_not_leak(pid, no_lease):
    p1, p2 = pid + "-1", pid + "-2"
    tq.kv_batch_put(["a"], p1, TensorDict({"secret": torch.full((1, 4), 7.0),
                                           "note": NonTensorStack("p1-data")}, batch_size=[1]),
                    tags=[{"owner": "p1"}])
    idx = indexes(p1, ["a"])[0]
    tq.kv_clear(["a"], p1)
    assert tq.kv_list(p1) == {}
    tq.kv_batch_put(["b"], p2, TensorDict({"other": torch.zeros(1, 2)}, batch_size=[1]))
    assert indexes(p2, ["b"]) == [idx]
    out = tq.kv_batch_get(["b"], p2)
    assert list(out.keys()) == ["other"] and out["other"].tolist() == [[0.0, 0.0]]
    assert tq.kv_list(p2)[p2]["b"] == {}
    with pytest.raises(KeyError):
        tq.kv_batch_get(["b"], p2, select_fields=["secret"])
    # the unit does not hand out p1's field either
    unit = tq.get_client().unit(idx % tq.get_client().num_units)
    with pytest.raises(KeyError):
        unit.call("GET_ROWS", {"indexes": [idx], "fields": ["secret"]})
    tq.kv_clear(["b"], p2)


def test_reused_index_key_without_fields_does_not_leak(pid, no_lease):
    p1, p2 = pid + "-1", pid + "-2"
    tq.kv_put("a", p1, {"secret": torch.full((3,), 9)})
    idx = indexes(p1, ["a"])[0]
    tq.kv_clear(["a"], p1)
    tq.kv_put("b", p2, tag={"only": "tag"})  # fresh index, no fields
    assert indexes(p2, ["b"]) == [idx]
    assert list(tq.kv_batch_get(["b"], p2).keys()) == []
    tq.kv_put("b", p2, {"y": torch.ones(1)})
    assert list(tq.kv_batch_get(["b"], p2).keys()) == ["y"]
    tq.kv_clear(["b"], p2)


def test_clear_most_of_a_batch_frees_unit_bytes(pid):
    """Rows cut from one big batch are stored per row: clearing most rows frees their bytes.

    Note: unit STATS "bytes" counts each stored value's logical size, so this observes that
    cleared rows are dropped, not whether a kept row pins its batch's buffer; that is checked
    at the codec level (each row travels as a frame of exactly its own bytes) in
    tests/client/test_tensors.py::test_row_views_cover_only_their_rows.
    """
    before = sum(u["bytes"] for u in unit_stats())
    n, width = 64, 4096
    keys = [f"k{i}" for i in range(n)]
    big = torch.randn(n, width)
    tq.kv_batch_put(keys, pid, TensorDict({"x": big}, batch_size=[n]))
    after_put = sum(u["bytes"] for u in unit_stats())
    assert after_put - before == n * width * 4
    tq.kv_clear(keys[2:], pid)
    after_clear = sum(u["bytes"] for u in unit_stats())
    assert after_clear - before == 2 * width * 4
    assert torch.equal(tq.kv_batch_get(keys[:2], pid)["x"], big[:2])
    tq.kv_clear(keys[:2], pid)


# ---------------------------------------------------------------- bad input
@pytest.fixture
def seeded(pid):
    tq.kv_batch_put(["a", "b"], pid, TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]),
                    tags=[{"t": 1}, {"t": 2}])
    return pid


def _check_unchanged(pid):
    assert tq.kv_list().get(pid) == {"a": {"t": 1}, "b": {"t": 2}}
    assert tq.kv_batch_get(["a", "b"], pid)["x"].tolist() == [[1.0] * 3] * 2


@pytest.mark.parametrize("keys, exc, match", [
    ([], ValueError, "empty"),
    (["a", 1], TypeError, "str"),
    (["c", "c"], ValueError, "duplicate"),
    (["a", "new", "a"], ValueError, "duplicate"),
])
def test_bad_keys_rejected_before_write(seeded, keys, exc, match):
    n = len(keys) if not isinstance(keys, str) else 1
    with pytest.raises(exc, match=match):
        tq.kv_batch_put(keys, seeded, TensorDict({"x": torch.zeros(n, 3)}, batch_size=[n]))
    _check_unchanged(seeded)
    if keys == []:
        with pytest.raises(ValueError):
            tq.kv_batch_get([], seeded)


def test_bad_key_types_in_other_calls(seeded):
    with pytest.raises(TypeError):
        tq.kv_put(1, seeded, {"x": torch.zeros(3)})
    with pytest.raises(TypeError):
        tq.kv_batch_get(["a", 2], seeded)
    with pytest.raises(ValueError, match="duplicate"):
        tq.kv_batch_get(["a", "a"], seeded)
    with pytest.raises(ValueError, match="partition_id"):  # the right type, a wrong value
        tq.kv_put("a", "", {"x": torch.zeros(3)})
    with pytest.raises(TypeError):
        tq.kv_put("a", seeded, {"x": torch.zeros(3)}, tag=["not", "a", "dict"])
    _check_unchanged(seeded)


def test_batch_size_mismatch(seeded):
    with pytest.raises(ValueError, match="batch size"):
        tq.kv_batch_put(["a", "b", "c"], seeded,
                        TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]))
    _check_unchanged(seeded)


def test_tags_length_mismatch(seeded):
    with pytest.raises(ValueError, match="tags"):
        tq.kv_batch_put(["a", "c"], seeded, TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]),
                        tags=[{"t": 9}])
    _check_unchanged(seeded)


def test_dtype_change_rejected_before_write(seeded):
    with pytest.raises(ValueError, match="dtype"):
        tq.kv_batch_put(["a", "c"], seeded,
                        TensorDict({"x": torch.zeros(2, 3, dtype=torch.int64)}, batch_size=[2]),
                        tags=[{"t": 9}, {"t": 9}])
    _check_unchanged(seeded)
    with pytest.raises(ValueError, match="dtype"):
        tq.kv_put("a", seeded, {"x": torch.zeros(3, dtype=torch.float16)})
    _check_unchanged(seeded)


def test_ndim_and_kind_change_rejected(seeded):
    with pytest.raises(ValueError):
        tq.kv_put("c", seeded, {"x": torch.zeros(3, 1)})
    with pytest.raises(ValueError):
        tq.kv_put("c", seeded, {"x": "not a tensor"})
    _check_unchanged(seeded)


def test_non_msgpackable_value_type_error_names_field(seeded):
    class Opaque:
        pass
    with pytest.raises(TypeError, match="'meta'"):
        tq.kv_put("c", seeded, {"x": torch.zeros(3), "meta": Opaque()})
    with pytest.raises(TypeError, match="'meta'"):
        tq.kv_put("c", seeded, {"x": torch.zeros(3), "meta": {"deep": [Opaque()]}})
    with pytest.raises(TypeError, match="'obj'"):
        tq.kv_batch_put(["c", "d"], seeded, TensorDict(
            {"x": torch.zeros(2, 3), "obj": NonTensorStack("ok", {1, 2})}, batch_size=[2]))
    with pytest.raises(TypeError, match="tag"):
        tq.kv_put("c", seeded, {"x": torch.zeros(3)}, tag={"bad": Opaque()})
    _check_unchanged(seeded)


# ---------------------------------------------------------------- async twins
def test_async_twins(pid):
    async def main():
        m = await tq.async_kv_put("a", pid, {"x": torch.ones(2)}, tag={"t": "a"})
        await tq.async_kv_batch_put(["b", "c"], pid,
                                    TensorDict({"x": torch.zeros(2, 2)}, batch_size=[2]),
                                    tags=[{"t": "b"}, {"t": "c"}])
        got = await tq.async_kv_batch_get(["c", "a"], pid)
        by_meta = await tq.async_kv_batch_get_by_meta(m)
        listed = await tq.async_kv_list(pid)
        await tq.async_kv_clear(["a"], pid)
        after = await tq.async_kv_list(pid)
        return got, by_meta, listed, after

    got, by_meta, listed, after = asyncio.run(main())
    assert got["x"].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert by_meta["x"].tolist() == [[1.0, 1.0]]
    assert listed == {pid: {"a": {"t": "a"}, "b": {"t": "b"}, "c": {"t": "c"}}}
    assert sorted(after[pid]) == ["b", "c"]
    assert tq.async_kv_put.__name__ == "async_kv_put"


def test_async_concurrent_puts_and_gets(pid):
    async def main():
        await asyncio.gather(*[tq.async_kv_put(f"k{i}", pid, {"x": torch.full((3,), i)})
                               for i in range(16)])
        return await asyncio.gather(*[tq.async_kv_batch_get([f"k{i}"], pid) for i in range(16)])

    outs = asyncio.run(main())
    assert [o["x"][0, 0].item() for o in outs] == list(range(16))


def test_mixed_tensor_and_object_rows_become_a_non_tensor_field(seeded):
    """TransferQueue's rule (was refused before): the mixed column is stored as a
    non-tensor field, with a warning, and reads back row by row."""
    with pytest.warns(UserWarning, match="'obj' mixes"):
        tq.kv_batch_put(["c", "d"], seeded, TensorDict(
            {"obj": NonTensorStack(torch.ones(2), "text")}, batch_size=[2]))
    got = tq.kv_batch_get(["c", "d"], seeded).get("obj").tolist()
    assert torch.equal(got[0], torch.ones(2)) and got[1] == "text"
