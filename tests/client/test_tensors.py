"""Client-side conversion (tqtx/client/tensors.py) between torch/tensordict and the wire value model.

Everything goes through the real codec (encode -> bytes -> decode) as it would on the wire.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tqtx.client import tensors as T
from tqtx.schema import column_schema
from tqtx.wire.codec import INLINE_LIMIT, decode, encode
from tqtx.wire.values import RawTensor

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
          torch.uint8]


def _wire(obj):
    return decode([bytes(memoryview(f)) for f in encode(obj)])


def round_trip(td, n=None):
    n = td.batch_size[0] if n is None else n
    cols = T.columns_from_tensordict(td, n)
    schemas = {f: column_schema(v) for f, v in cols.items()}
    back = _wire({"cols": {f: list(v) for f, v in cols.items()}})["cols"]
    return schemas, T.tensordict_from_columns(back, schemas, n)


def _sample(dtype, shape):
    x = torch.arange(int(np.prod(shape)) if shape else 1).reshape(shape)
    if dtype == torch.bool:
        return (x % 3 == 0)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row_shape", [(), (0,), (3,), (2, 3, 4)], ids=str)
def test_dense_round_trip_dtypes_and_shapes(dtype, row_shape):
    x = _sample(dtype, (4, *row_shape))
    schemas, td = round_trip(TensorDict({"x": x}, batch_size=[4]))
    assert schemas["x"] == {"kind": "tensor", "dtype": str(dtype).removeprefix("torch."),
                            "shape": list(row_shape), "jagged": False, "ndim": len(row_shape)}
    out = td.get("x")
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_tensor_raw_round_trip(dtype):
    x = _sample(dtype, (2, 5))
    r = _wire([T.to_raw(x)])[0]
    assert r.dtype == str(dtype).removeprefix("torch.")
    y = T.from_raw(r)
    assert y.dtype == dtype and torch.equal(y, x)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24.).reshape(4, 6).t(),                    # transposed
    lambda: torch.arange(100).reshape(10, 10)[2:8:2, 1:9:3],        # strided slice + offset
    lambda: torch.ones(1, 3).expand(5, 3),                          # stride 0
    lambda: torch.arange(60, dtype=torch.int32).reshape(3, 4, 5).permute(2, 0, 1),
], ids=["transposed", "strided", "expanded", "permuted"])
def test_non_contiguous_input(make):
    x = make()
    assert not x.is_contiguous()
    _, td = round_trip(TensorDict({"x": x}, batch_size=[x.shape[0]]))
    assert torch.equal(td.get("x"), x)
    assert torch.equal(T.from_raw(_wire([T.to_raw(x[1])])[0]), x[1])


def test_row_views_cover_only_their_rows():
    big = torch.arange(1000 * 64, dtype=torch.float32).reshape(1000, 64)
    cols = T.columns_from_tensordict(TensorDict({"x": big}, [1000]), 1000)
    r = cols["x"][500]
    assert memoryview(r.data).nbytes == 64 * 4
    # on the wire each row above the inline limit is its own frame of exactly its bytes
    per_row = 2 * INLINE_LIMIT // 4  # float32 values: a row of twice the inline limit
    big2 = torch.zeros(10, per_row, dtype=torch.float32)
    cols2 = T.columns_from_tensordict(TensorDict({"x": big2}, [10]), 10)
    frames = encode({"rows": [cols2["x"][3]]})
    assert [memoryview(f).nbytes for f in frames[1:]] == [per_row * 4]
    out = decode([bytes(memoryview(f)) for f in frames])["rows"][0]
    assert memoryview(out.data).nbytes == per_row * 4


def test_jagged_round_trip_including_empty_rows():
    rows = [torch.arange(2.), torch.arange(5.), torch.arange(0.), torch.arange(1.)]
    nt = torch.nested.nested_tensor(rows, layout=torch.jagged)
    schemas, td = round_trip(TensorDict({"x": nt}, batch_size=[4]))
    assert schemas["x"]["jagged"] and schemas["x"]["shape"] is None and schemas["x"]["ndim"] == 1
    out = td.get("x")
    assert out.is_nested and out.layout == torch.jagged
    assert [t.tolist() for t in out.unbind()] == [t.tolist() for t in rows]


def test_jagged_multi_dim_rows():
    rows = [torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.bfloat16)]
    nt = torch.nested.nested_tensor(rows, layout=torch.jagged)
    _, td = round_trip(TensorDict({"x": nt}, batch_size=[2]))
    got = td.get("x").unbind()
    assert [g.shape for g in got] == [(2, 3), (4, 3)]
    assert all(torch.equal(a, b) for a, b in zip(got, rows))


def test_strided_nested_with_different_trailing_dims():
    rows = [torch.ones(3, 2), torch.zeros(3, 4)]
    nt = torch.nested.nested_tensor(rows)
    _, td = round_trip(TensorDict({"x": nt}, batch_size=[2]))
    got = td.get("x").unbind()
    assert [g.shape for g in got] == [(3, 2), (3, 4)]


def test_non_contiguous_jagged_tensor_rows():
    """A narrowed jagged tensor (has lengths) must store each row's own elements only."""
    base = torch.arange(20.).reshape(4, 5)
    nt = torch.nested.narrow(base, 1, torch.tensor([0, 1, 2, 0]), torch.tensor([2, 3, 1, 4]),
                             layout=torch.jagged)
    expect = [t.tolist() for t in nt.unbind()]
    _, td = round_trip(TensorDict({"x": nt}, batch_size=[4]))
    assert [t.tolist() for t in td.get("x").unbind()] == expect


def test_jagged_equal_shapes_come_back_dense():
    nt = torch.nested.nested_tensor([torch.ones(3), torch.zeros(3)], layout=torch.jagged)
    _, td = round_trip(TensorDict({"x": nt}, batch_size=[2]))
    assert not td.get("x").is_nested and td.get("x").shape == (2, 3)


def test_non_tensor_stack_round_trip_with_nested_tensors():
    vals = ["a", {"k": torch.arange(3), "l": [1, 2.5, None]}, None, b"\x00\x01", True, 7]
    td0 = TensorDict({"s": NonTensorStack(*vals)}, batch_size=[len(vals)])
    schemas, td = round_trip(td0)
    assert schemas["s"] == {"kind": "object"}
    out = td.get("s")
    assert isinstance(out, NonTensorStack)
    got = out.tolist()
    assert got[0] == "a" and got[2] is None and got[3] == b"\x00\x01" and got[4] is True
    assert torch.equal(got[1]["k"], torch.arange(3)) and got[1]["l"] == [1, 2.5, None]


def test_non_tensor_stack_of_bare_tensors_is_a_tensor_column():
    """A column whose rows are all bare tensors is a tensor field (an object field never
    holds a bare tensor: the dump format checks that), so it comes back as a tensor."""
    td0 = TensorDict({"s": NonTensorStack(torch.ones(2), torch.ones(3))}, batch_size=[2])
    schemas, td = round_trip(td0)
    assert schemas["s"]["kind"] == "tensor" and schemas["s"]["jagged"]
    assert [t.tolist() for t in td.get("s").unbind()] == [[1.0, 1.0], [1.0, 1.0, 1.0]]


def _same_value(a, b) -> bool:
    """Equal with the same types and, for tensors, the same dtype, shape and bits."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bytes(T.to_raw(a).data) == bytes(T.to_raw(b).data))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(_same_value(a[k], b[k]) for k in a))
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same_value, a, b))
    return type(a) is type(b) and a == b


MIXED_COLUMNS = {
    "dtypes": [torch.tensor([1]), torch.tensor([1.5])],
    "ranks": [torch.tensor(7, dtype=torch.int16), torch.ones(2, 2, dtype=torch.bfloat16)],
    "with_objects": [torch.tensor([True, False]), "x", None, {"t": torch.arange(2)}],
}


@pytest.mark.parametrize("name", sorted(MIXED_COLUMNS))
def test_mixed_column_is_a_non_tensor_field_with_a_warning(name):
    """Tensors of different dtypes or ranks, or tensors with objects, in one column: stored
    as a non-tensor field (with a warning), each row back exactly as put."""
    rows = MIXED_COLUMNS[name]
    td0 = TensorDict({"s": NonTensorStack(*rows)}, batch_size=[len(rows)])
    with pytest.warns(UserWarning, match="'s' mixes .* non-tensor field"):
        schemas, td = round_trip(td0)
    assert schemas["s"] == {"kind": "object"}
    back = td.get("s")
    assert isinstance(back, NonTensorStack)
    assert all(_same_value(a, b) for a, b in zip(rows, back.tolist(), strict=True))


def test_uniform_tensor_column_is_still_a_tensor_field_without_warning():
    import warnings
    td0 = TensorDict({"s": NonTensorStack(torch.ones(2), torch.zeros(3))}, batch_size=[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schemas, _ = round_trip(td0)
    assert schemas["s"]["kind"] == "tensor"


def test_field_objects_that_look_like_the_tensor_wrapper_round_trip():
    """A non-tensor row that is a bare tensor travels wrapped; a user's dict shaped like
    the wrapper is escaped, so both come back as they were."""
    rows = [{"__tqtx_tensor__": torch.ones(1)}, {"__tqtx_escaped__": 1}, torch.arange(3), "s"]
    cols = {"o": [T.encode_field_object(v, "o") for v in rows]}
    assert not any(isinstance(v, RawTensor) for v in cols["o"])
    back = _wire(cols)["o"]
    assert all(_same_value(a, T.decode_field_object(b)) for a, b in zip(rows, back))


def test_non_tensor_data_broadcast_column():
    td0 = TensorDict({}, batch_size=[3])
    td0.set_non_tensor("c", "same")
    assert isinstance(td0.get("c"), NonTensorData)
    _, td = round_trip(td0)
    assert td.get("c").tolist() == ["same"] * 3


def test_non_msgpackable_value_names_field():
    class Opaque:
        pass
    with pytest.raises(TypeError, match="'obs'.*Opaque"):
        T.encode_object({"a": [Opaque()]}, "obs")
    with pytest.raises(TypeError, match="'meta'"):
        T.columns_from_dict({"meta": {1, 2}})
    with pytest.raises(TypeError, match="'s'"):
        T.columns_from_tensordict(
            TensorDict({"s": NonTensorStack(object(), "x")}, batch_size=[2]), 2)


def test_encode_object_numpy_and_bytes_like():
    assert T.encode_object(np.int64(3), "f") == 3
    assert T.encode_object(bytearray(b"ab"), "f") == b"ab"
    r = T.encode_object(np.arange(4, dtype=np.int32), "f")
    assert isinstance(r, RawTensor) and r.dtype == "int32" and r.shape == (4,)
    assert T.encode_object((1, 2), "f") == [1, 2]


def test_columns_from_dict_tensor_and_non_tensor():
    cols = T.columns_from_dict({"x": torch.ones(2, 3), "s": "txt", "n": {"t": torch.ones(1)}})
    assert column_schema(cols["x"])["shape"] == [2, 3]
    assert column_schema(cols["s"]) == {"kind": "object"}
    assert column_schema(cols["n"]) == {"kind": "object"}
    with pytest.raises(TypeError, match="field names"):
        T.columns_from_dict({1: torch.ones(1)})


def test_batch_size_mismatch_and_nested_tensordict_refused():
    with pytest.raises(ValueError, match="does not match"):
        T.columns_from_tensordict(TensorDict({"x": torch.ones(3)}, [3]), 4)
    td = TensorDict({"sub": TensorDict({"y": torch.ones(2)}, [2])}, [2])
    with pytest.raises(TypeError, match="nested TensorDicts"):
        T.columns_from_tensordict(td, 2)


def test_column_schema_rejects_mixed_ndim():
    vals = [T.to_raw(torch.ones(2)), T.to_raw(torch.ones(2, 2))]
    with pytest.raises(ValueError, match="different numbers of dimensions"):
        column_schema(vals)


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="unsupported tensor dtype"):
        T.dtype_name(torch.quint8)


def test_scalar_rows_assemble_to_1d():
    _, td = round_trip(TensorDict({"r": torch.tensor([1.5, 2.5, 3.5])}, [3]))
    assert td.get("r").shape == (3,) and td.get("r").tolist() == [1.5, 2.5, 3.5]


def test_from_raw_copies():
    buf = bytearray(np.arange(4, dtype=np.int32).tobytes())
    y = T.from_raw(RawTensor("int32", (4,), buf))
    buf[0] = 99
    assert y.tolist() == [0, 1, 2, 3]


def test_decode_object_makes_new_containers():
    tag = {"a": 1, "xs": [1, {"y": 2}], "t": T.encode_object(torch.arange(3), "tag")}
    out = T.decode_object(tag)
    assert out is not tag and out["xs"] is not tag["xs"] and out["xs"][1] is not tag["xs"][1]
    assert out["a"] == 1 and out["xs"] == [1, {"y": 2}] and torch.equal(out["t"], torch.arange(3))
