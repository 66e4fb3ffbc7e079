"""tqtx.BatchMeta behaves as TransferQueue 0.1.11's BatchMeta (construction, chunking,
selection, concat, reorder, union, pickling), and keeps each sample's key through all of it."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from tqtx import BatchMeta


def _meta(n=5, keys=True, nested=False):
    schema = {"x": {"dtype": torch.int64, "shape": torch.Size([3]), "is_nested": False,
                    "is_non_tensor": False}}
    if nested:
        schema["y"] = {"dtype": torch.float32, "shape": None, "is_nested": True,
                       "is_non_tensor": False, "per_sample_shapes": [(i + 1,) for i in range(n)]}
    return BatchMeta(list(range(10, 10 + n)), ["p"] * n, schema, [1] * n, {"step": 3},
                     [{"i": i} for i in range(n)],
                     keys=[f"k{i}" for i in range(n)] if keys else None)


def test_construction_and_properties():
    m = _meta()
    assert m.size == len(m) == 5 and m.is_ready and m.field_names == ["x"]
    assert m.sample_keys == ["k0", "k1", "k2", "k3", "k4"]
    assert m.get_dtypes("x") == [torch.int64] * 5 and m.get_shapes("x") == [torch.Size([3])] * 5
    with pytest.raises(KeyError):
        m.get_shapes("nope")
    assert m.samples[2].global_index == 12 and m.samples[2].custom_meta["i"] == 2
    with pytest.raises(TypeError):
        m.samples[2].custom_meta["i"] = 9  # a read-only view
    assert not BatchMeta([1], ["p"]).is_ready  # production defaults to not produced
    assert BatchMeta().size == 0 and not BatchMeta.empty().is_ready
    with pytest.raises(ValueError, match="Length mismatch"):
        BatchMeta([1, 2], ["p"])
    with pytest.raises(ValueError, match="custom_meta"):
        BatchMeta([1], ["p"], custom_meta=[{}, {}])


def test_chunk_select_reorder_keep_rows_together():
    m = _meta(nested=True)
    parts = m.chunk(2)
    assert [p.global_indexes for p in parts] == [[10, 11, 12], [13, 14]]
    assert [p.sample_keys for p in parts] == [["k0", "k1", "k2"], ["k3", "k4"]]
    assert parts[1].field_schema["y"]["per_sample_shapes"] == [(4,), (5,)]
    assert parts[1].custom_meta == [{"i": 3}, {"i": 4}] and parts[0].extra_info == {"step": 3}
    assert len(m.chunk(7)) == 7 and m.chunk(7)[6].size == 0
    sel = m.select_samples([4, 0])
    assert sel.sample_keys == ["k4", "k0"] and sel.global_indexes == [14, 10]
    with pytest.raises(ValueError):
        m.select_samples([5])
    assert m[1].sample_keys == ["k1"] and m[-1].sample_keys == ["k4"]
    assert m[1:3].sample_keys == ["k1", "k2"]
    only = m.select_fields(["y", "absent"])  # fields it does not have are left out
    assert only.field_names == ["y"] and only.sample_keys == m.sample_keys
    m.reorder([4, 3, 2, 1, 0])
    assert m.sample_keys == ["k4", "k3", "k2", "k1", "k0"]
    assert m.custom_meta[0] == {"i": 4} and m.field_schema["y"]["per_sample_shapes"][0] == (5,)
    with pytest.raises(ValueError, match="duplicates"):
        m.reorder([0, 0, 1, 2, 3])


def test_concat_merges_chunks_and_checks_them():
    m = _meta(nested=True)
    whole = BatchMeta.concat(m.chunk(3))
    assert whole.global_indexes == m.global_indexes and whole.sample_keys == m.sample_keys
    assert whole.field_schema["y"]["per_sample_shapes"] == m.field_schema["y"]["per_sample_shapes"]
    assert whole.production_status.tolist() == [1] * 5 and whole.extra_info == {"step": 3}
    assert BatchMeta.concat([]).size == 0
    other = _meta(2, keys=False)
    assert BatchMeta.concat([_meta(2), other]).sample_keys is None  # a hand-built chunk
    with pytest.raises(ValueError, match="field_names mismatch"):
        BatchMeta.concat([_meta(2), _meta(2, nested=True)])
    clash = _meta(2)
    clash.extra_info["step"] = 4
    with pytest.raises(ValueError, match="conflicting"):
        BatchMeta.concat([_meta(2), clash])


def test_add_fields_union_and_custom_meta():
    m = BatchMeta([1, 2], ["p", "p"], custom_meta=[{"a": 1}, {}], keys=["a", "b"])
    td = TensorDict({"t": torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)],
                                                        layout=torch.jagged),
                     "s": NonTensorStack("x", "y"), "v": torch.ones(2)}, batch_size=[2])
    assert m.add_fields(td) is m and m.is_ready and m.field_names == ["s", "t", "v"]
    assert m.field_schema["t"]["per_sample_shapes"] == [(2,), (3,)]
    assert m.field_schema["s"]["is_non_tensor"] and m.field_schema["v"]["shape"] == (1,)
    with pytest.raises(ValueError, match="batch size mismatch"):
        m.add_fields(TensorDict({"t": torch.ones(3)}, batch_size=[3]))
    m.update_custom_meta([{"b": 2}, {"c": 3}])
    assert m.get_all_custom_meta() == [{"a": 1, "b": 2}, {"c": 3}]
    half = BatchMeta([1, 2], ["p", "p"], production_status=[1, 0], custom_meta=[{"z": 0}, {}])
    both = m.union(half)
    assert both.production_status.tolist() == [1, 0] and both.custom_meta[0]["z"] == 0
    with pytest.raises(ValueError, match="global_indexes"):
        m.union(BatchMeta([3, 4], ["p", "p"]))


def test_pickle_keeps_everything_and_status_is_writable():
    m = _meta(nested=True)
    back = pickle.loads(pickle.dumps(m))
    assert (back.global_indexes, back.sample_keys, back.custom_meta, back.field_schema) == \
        (m.global_indexes, m.sample_keys, m.custom_meta, m.field_schema)
    frozen = np.ones(5, dtype=np.int8)
    frozen.setflags(write=False)  # what Ray's zero-copy deserialization hands over
    state = (None, {**{s: getattr(m, s) for s in BatchMeta.__slots__},
                    "production_status": frozen})
    fresh = BatchMeta.__new__(BatchMeta)
    fresh.__setstate__(state)
    fresh.production_status[0] = 0
    assert fresh.production_status.tolist() == [0, 1, 1, 1, 1]
