"""Client-side conversion between torch/tensordict batches and the torch-free value model."""
from __future__ import annotations

import warnings

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from .wire.values import DTYPE_SIZES, RawTensor

_TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise TypeError(f"unsupported tensor dtype {dtype}")
    return name


def _byte_view(t: torch.Tensor) -> memoryview:
    """A memoryview of the bytes of contiguous tensor ``t`` (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def to_raw(t: torch.Tensor) -> RawTensor:
    """A RawTensor viewing ``t``'s bytes (copied only if ``t`` is not contiguous on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_nested:
        raise TypeError("nested tensors are only supported as batch columns")
    t = t.contiguous()
    return RawTensor(dtype_name(t.dtype), t.shape, _byte_view(t))


def from_raw(r: RawTensor) -> torch.Tensor:
    """A new tensor holding a copy of ``r``'s bytes."""
    dtype = _TORCH_DTYPES[r.dtype]
    out = torch.empty(r.shape, dtype=dtype)
    if out.numel():
        np.copyto(np.asarray(_byte_view(out)), np.frombuffer(r.data, dtype=np.uint8))
    return out


def encode_object(value, field: str):
    """Check a non-tensor value is msgpack-able; convert tensors inside it to RawTensors."""
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    if isinstance(value, torch.Tensor):
        return to_raw(value)
    if isinstance(value, (list, tuple)):
        return [encode_object(v, field) for v in value]
    if isinstance(value, dict):
        return {encode_object(k, field): encode_object(v, field) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return to_raw(torch.from_numpy(value))
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(
        f"field {field!r}: values of type {type(value).__name__} cannot be stored without pickle; "
        f"use str, bytes, numbers, bool, None, lists, dicts or tensors")


def decode_object(value):
    """Inverse of :func:`encode_object`: RawTensors become torch tensors."""
    if isinstance(value, RawTensor):
        return from_raw(value)
    if isinstance(value, list):
        return [decode_object(v) for v in value]
    if isinstance(value, dict):
        return {k: decode_object(v) for k, v in value.items()}
    return value


def column_schema(values: list) -> dict:
    """Field schema of one batch column of RawTensors or objects."""
    tensors = sum(1 for v in values if isinstance(v, RawTensor))
    if tensors and tensors != len(values):
        # an object field never holds a bare tensor (the dump format relies on it)
        raise ValueError("rows mix tensors and non-tensor values")
    if not tensors:
        return {"kind": "object"}
    shapes = {v.shape for v in values}
    ndims = {len(s) for s in shapes}
    if len(ndims) > 1:
        raise ValueError(f"rows have different numbers of dimensions: {sorted(ndims)}")
    shape = next(iter(shapes)) if len(shapes) == 1 else None
    return {"kind": "tensor", "dtype": values[0].dtype,
            "shape": list(shape) if shape is not None else None,
            "jagged": shape is None, "ndim": ndims.pop()}


def _rows_of_dense(t: torch.Tensor) -> list[RawTensor]:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    n = t.shape[0]
    row_shape = tuple(t.shape[1:])
    name = dtype_name(t.dtype)
    view = _byte_view(t)
    rs = view.nbytes // n if n else 0
    return [RawTensor(name, row_shape, view[i * rs:(i + 1) * rs]) for i in range(n)]


def _rows_of_nested(t: torch.Tensor) -> list[RawTensor]:
    if t.layout == torch.jagged and t._ragged_idx == 1:
        values = t.values().detach().cpu().contiguous()
        offsets = t.offsets().tolist()
        lengths = t.lengths()  # not None for a non-contiguous (narrowed) jagged tensor
        lengths = (lengths.tolist() if lengths is not None else
                   [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)])
        name = dtype_name(values.dtype)
        rest = tuple(values.shape[1:])
        per = int(np.prod(rest)) * values.element_size() if rest else values.element_size()
        view = _byte_view(values)
        return [RawTensor(name, (lengths[i], *rest),
                          view[offsets[i] * per:(offsets[i] + lengths[i]) * per])
                for i in range(len(lengths))]
    return [to_raw(x) for x in t.unbind()]


def columns_from_tensordict(td: TensorDict, n: int) -> dict[str, list]:
    """Split a batch into per-row values per field (tensors as RawTensor views, no copy)."""
    if not isinstance(td, TensorDict) and hasattr(td, "to_tensordict"):
        td = td.to_tensordict()
    if tuple(td.batch_size)[:1] != (n,):
        raise ValueError(f"fields batch size {list(td.batch_size)} does not match the "
                         f"{n} keys")
    columns: dict[str, list] = {}
    for field in td.keys(include_nested=False, leaves_only=False):
        if not isinstance(field, str):
            raise TypeError(f"field names must be str, got {field!r}")
        col = td.get(field)
        if isinstance(col, NonTensorStack):
            columns[field] = [encode_object(v, field) for v in col.tolist()]
        elif isinstance(col, NonTensorData):
            data = col.tolist() if hasattr(col, "tolist") else [col.data] * n
            columns[field] = [encode_object(v, field) for v in data]
        elif isinstance(col, torch.Tensor):
            columns[field] = _rows_of_nested(col) if col.is_nested else _rows_of_dense(col)
        elif isinstance(col, TensorDict):
            raise TypeError(f"field {field!r}: nested TensorDicts are not supported; flatten "
                            f"them with td.flatten_keys()")
        else:
            raise TypeError(f"field {field!r}: unsupported column type {type(col).__name__}")
    return columns


def columns_from_dict(fields: dict) -> dict[str, list]:
    """One row from ``kv_put``'s dict: tensors are the row itself, other values non-tensor."""
    columns = {}
    for field, value in fields.items():
        if not isinstance(field, str):
            raise TypeError(f"field names must be str, got {field!r}")
        if isinstance(value, torch.Tensor) and not value.is_nested:
            columns[field] = [to_raw(value)]
        else:
            columns[field] = [encode_object(value, field)]
    return columns


def _scatter_packed(out: torch.Tensor, values) -> bool:
    """Fill dense ``out`` from the units' packed buffers with one vectorized copy per unit
    (``values.chunks``: ``[(positions, raw uint8 buffer)]`` covering every row)."""
    chunks = getattr(values, "chunks", None)
    if not chunks or sum(len(p) for p, _ in chunks) != len(values) or out.numel() == 0:
        return False
    rows = out.view(len(values), -1).view(torch.uint8) if out.dim() else None
    if rows is None:
        return False
    for positions, raw in chunks:
        with warnings.catch_warnings():  # read-only receive buffer: we only read from it
            warnings.simplefilter("ignore")
            src = torch.frombuffer(raw.data, dtype=torch.uint8).view(len(positions), -1)
        first, n = positions[0], len(positions)
        step = positions[1] - first if n > 1 else 1
        if step > 0 and positions == list(range(first, first + step * n, step)):
            # the usual case: index % N routing gives every N-th row to one unit
            rows[first:first + step * (n - 1) + 1:step].copy_(src)
        else:
            rows.index_copy_(0, torch.tensor(positions, dtype=torch.int64), src)
    return True


def assemble_column(values: list, schema: dict):
    """Build a batch column: dense tensor, jagged nested tensor or NonTensorStack."""
    if schema.get("kind") != "tensor" or not values or not isinstance(values[0], RawTensor):
        return NonTensorStack(*[decode_object(v) for v in values]) if values else None
    dtype = _TORCH_DTYPES[values[0].dtype]
    shapes = {v.shape for v in values}
    if len(shapes) == 1:
        shape = next(iter(shapes))
        out = torch.empty((len(values), *shape), dtype=dtype)
        if _scatter_packed(out, values):
            return out
        dst = np.asarray(_byte_view(out)) if out.numel() else None
        if dst is not None:
            rs = dst.nbytes // len(values)
            for i, v in enumerate(values):
                dst[i * rs:(i + 1) * rs] = np.frombuffer(v.data, dtype=np.uint8)
        return out
    rests = {s[1:] for s in shapes}
    if len(rests) == 1 and all(len(s) >= 1 for s in shapes):
        rest = next(iter(rests))
        lengths = [v.shape[0] for v in values]
        total = sum(lengths)
        flat = torch.empty((total, *rest), dtype=dtype)
        dst = np.asarray(_byte_view(flat)) if flat.numel() else None
        pos = 0
        for v in values:
            nb = v.nbytes
            if nb:
                dst[pos:pos + nb] = np.frombuffer(v.data, dtype=np.uint8)
            pos += nb
        offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
        return torch.nested.nested_tensor_from_jagged(flat, offsets)
    return torch.nested.nested_tensor([from_raw(v) for v in values])


def tensordict_from_columns(columns: dict, schemas: dict, n: int) -> TensorDict:
    td = TensorDict({}, batch_size=[n])
    for field, values in columns.items():
        col = assemble_column(values, schemas.get(field, {}))
        if col is None:
            continue
        td.set(field, col)
    return td
