"""Client-side conversion between torch/tensordict batches and the torch-free value model."""
from __future__ import annotations

import os
import threading
import warnings
from math import prod

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from ..layout import fsutil, pages
from . import batches, result_layout
from .nested import jagged
from ..arguments.kinds import check_utf8
from ..wire import shm
from ..wire.values import DTYPE_SIZES, RawTensor

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


def _plain(t: torch.Tensor, field) -> torch.Tensor:
    """``t`` detached, on CPU, with conj / neg views materialized (they hold a valid value).
    Tensors without strided bytes to store (sparse, mkldnn, meta, quantized) are a TypeError
    naming the field, raised before anything is sent."""
    t = t.detach()
    where = f"field {field!r}: " if field is not None else ""
    if t.layout != torch.strided:
        raise TypeError(f"{where}{str(t.layout).removeprefix('torch.')} tensors cannot be "
                        f"stored, only dense (strided) ones; convert with .to_dense()")
    if t.is_meta:
        raise TypeError(f"{where}meta tensors have no data to store")
    if t.is_quantized:
        raise TypeError(f"{where}quantized tensors ({t.dtype}) cannot be stored; store "
                        f".dequantize() or .int_repr() with its scale and zero point")
    if str(t.dtype).removeprefix("torch.") not in _TORCH_DTYPES:
        raise TypeError(f"{where}unsupported tensor dtype {t.dtype}")
    if t.device.type != "cpu":
        t = t.cpu()
    return t.resolve_conj().resolve_neg()


def to_raw(t: torch.Tensor, field=None) -> RawTensor:
    """A RawTensor viewing ``t``'s bytes (copied only if ``t`` is not contiguous on CPU)."""
    if t.is_nested:
        where = f"field {field!r}: " if field is not None else ""
        raise TypeError(f"{where}nested tensors are only supported as batch columns")
    t = _plain(t, field).contiguous()
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
    if isinstance(value, str):
        check_utf8(f"field {field!r}", value)
        return value
    if isinstance(value, int) and not isinstance(value, bool) \
            and not -(1 << 63) <= value < (1 << 64):
        raise ValueError(f"field {field!r}: the int {value} does not fit in 64 bits (what "
                         f"msgpack stores); store it as a str")
    if value is None or isinstance(value, (bytes, bool, int, float)):
        return value
    if isinstance(value, torch.Tensor):
        return to_raw(value, field)
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
    """Inverse of :func:`encode_object`: RawTensors become torch tensors; lists and dicts
    are new objects."""
    if type(value) is dict:  # a tag: most of its values are plain
        out = dict(value)
        for k, v in out.items():
            if isinstance(v, NEEDS_DECODING):
                out[k] = decode_object(v)
        return out
    if isinstance(value, RawTensor):
        return from_raw(value)
    if isinstance(value, list):
        return [decode_object(v) for v in value]
    if isinstance(value, dict):
        return {k: decode_object(v) for k, v in value.items()}
    return value


NEEDS_DECODING = (RawTensor, list, dict)


# A row of a non-tensor field never is a bare RawTensor (a unit or a dump record would take
# it for a tensor field), so a tensor that is a whole row travels as {_TENSOR: tensor}; a
# user's dict that looks like one of these wrappers travels inside {_ESCAPED: dict}.
_TENSOR = "__tqtx_tensor__"
_ESCAPED = "__tqtx_escaped__"


def encode_field_object(value, field: str):
    """One row of a non-tensor field, without pickle (see :func:`encode_object`)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return {_TENSOR: encode_object(value, field)}
    out = encode_object(value, field)
    if isinstance(out, dict) and len(out) == 1 and next(iter(out)) in (_TENSOR, _ESCAPED):
        return {_ESCAPED: out}
    return out


def decode_field_object(value):
    """Inverse of :func:`encode_field_object`."""
    if isinstance(value, dict) and len(value) == 1:
        if isinstance(value.get(_TENSOR), RawTensor):
            return from_raw(value[_TENSOR])
        if _ESCAPED in value:
            return decode_object(value[_ESCAPED])
    return decode_object(value)


def _column_of_values(values: list, field: str) -> list:
    """Per-row values of a non-tensor-typed column (NonTensorStack / NonTensorData).

    Tensors of one dtype and rank make a tensor field (as before). A column mixing tensors
    of different dtypes or ranks, or tensors with other values, becomes a non-tensor field
    (every row kept exactly, tensors with their dtypes) with a warning."""
    is_tensor = [isinstance(v, (torch.Tensor, np.ndarray)) for v in values]
    if not any(is_tensor):
        return [encode_field_object(v, field) for v in values]
    if all(is_tensor):
        rows = [encode_object(v, field) for v in values]
        if len({(r.dtype, len(r.shape)) for r in rows}) == 1:
            return rows
        why = "tensors of different dtypes or ranks"
    else:
        why = "tensors and non-tensor values"
    warnings.warn(f"field {field!r} mixes {why}; it is stored as a non-tensor field "
                  f"(each row comes back as it was put, in a NonTensorStack)", stacklevel=4)
    return [encode_field_object(v, field) for v in values]


class TensorRows(list):
    """The rows of one tensor field split from a batch (RawTensor views into one buffer)
    and where they lie: :meth:`where` gives each row's address in this process and its size
    in bytes, for a same-host put that names rows by address (:mod:`tqtx.client.put_from`).
    Both are computed in one step from the buffer's address and the rows' offsets, and only
    when asked for (a small put never is)."""

    __slots__ = ("_layout",)

    def where(self) -> tuple[np.ndarray, np.ndarray]:
        """``(addresses, sizes)``: numpy uint64 arrays, one entry per row."""
        base, starts, sizes, per = self._layout
        if type(starts) is not np.ndarray:
            n = len(self)
            if starts is None:  # dense: rows of ``per`` bytes back to back
                starts = np.arange(n, dtype=np.uint64) * np.uint64(per)
                sizes = np.full(n, per, dtype=np.uint64)
            else:  # jagged: element offsets and lengths, ``per`` bytes an element
                starts = np.asarray(starts[:n], dtype=np.uint64) * np.uint64(per)
                sizes = np.asarray(sizes, dtype=np.uint64) * np.uint64(per)
            starts += np.uint64(base)
            self._layout = (base, starts, sizes, per)
        return starts, sizes


def _row_list(rows: list, base: int, starts, sizes, per: int) -> TensorRows:
    out = TensorRows(rows)
    out._layout = (base, starts, sizes, per)
    return out


def _rows_of_dense(t: torch.Tensor, field=None) -> list[RawTensor]:
    t = _plain(t, field).contiguous()
    n = t.shape[0]
    row_shape = tuple(t.shape[1:])
    name = dtype_name(t.dtype)
    view = _byte_view(t)
    rs = view.nbytes // n if n else 0
    new = RawTensor.of  # the shapes are tuples of ints already
    rows = [new(name, row_shape, view[i * rs:(i + 1) * rs]) for i in range(n)]
    return _row_list(rows, t.data_ptr() if rs else 0, None, None, rs)


def _rows_of_nested(t: torch.Tensor, field=None) -> list[RawTensor]:
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
        new = RawTensor.of  # lengths and rest are ints already
        rows = [new(name, (lengths[i], *rest),
                    view[offsets[i] * per:(offsets[i] + lengths[i]) * per])
                for i in range(len(lengths))]
        return _row_list(rows, values.data_ptr() if view.nbytes else 0, offsets, lengths,
                         per)
    return [to_raw(x, field) for x in t.unbind()]


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
        check_utf8("field names", field)
        col = td.get(field)
        if isinstance(col, NonTensorStack):
            columns[field] = _column_of_values(col.tolist(), field)
        elif isinstance(col, NonTensorData):
            data = col.tolist() if hasattr(col, "tolist") else [col.data] * n
            columns[field] = _column_of_values(data, field)
        elif isinstance(col, torch.Tensor):
            columns[field] = (_rows_of_nested(col, field) if col.is_nested
                              else _rows_of_dense(col, field))
        elif isinstance(col, TensorDict):
            raise TypeError(f"field {field!r}: nested TensorDicts are not supported; flatten "
                            f"them with td.flatten_keys()")
        else:
            raise TypeError(f"field {field!r}: unsupported column type {type(col).__name__}")
    return columns


def batch_from_dict(fields, n: int) -> TensorDict:
    """``kv_batch_put``'s plain dict of batched columns as a TensorDict of ``n`` rows; a
    column that does not hold one value per key is a ValueError naming it."""
    for name, value in fields.items():
        shape = getattr(value, "shape", None)
        if shape is not None and (len(shape) == 0 or shape[0] != n):
            raise ValueError(f"kv_batch_put(): fields[{name!r}] has shape {list(shape)}: a "
                             f"column holds one value per key ({n})")
    try:
        return TensorDict(dict(fields), batch_size=[n])
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"kv_batch_put(): fields is not a batch of {n} rows: {exc}") from None


def columns_from_dict(fields: dict) -> dict[str, list]:
    """One row from ``kv_put``'s dict: tensors are the row itself, other values non-tensor."""
    columns = {}
    for field, value in fields.items():
        if not isinstance(field, str):
            raise TypeError(f"field names must be str, got {field!r}")
        check_utf8("field names", field)
        if isinstance(value, torch.Tensor) and value.is_nested:
            # TransferQueue's error too: a nested tensor is a batch, not one sample
            raise ValueError(f"field {field!r}: kv_put takes one sample, got a nested tensor; "
                             f"use kv_batch_put for a batch")
        if isinstance(value, torch.Tensor):
            columns[field] = [to_raw(value, field)]
        else:
            columns[field] = [encode_field_object(value, field)]
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


def result_buffer(nbytes: int):
    """A fresh, untouched byte tensor for units to copy a get's rows into (see
    :meth:`tqtx.client.result_layout.ColumnPlan.open`): (tensor, address, numpy view)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= pages.RESULT_MIN:  # before the first touch: huge pages fault in cheaper
        pages.advise_huge(t.data_ptr(), nbytes)
    return t, t.data_ptr(), t.numpy()


def _from_plan(plan):
    """The column whose rows the units copied into ``plan``'s buffer: a dense tensor or a
    jagged nested tensor over that buffer, without a copy."""
    flat = plan.memory.view(_TORCH_DTYPES[plan.dtype])
    if plan.shape is not None:
        return flat.view(len(plan.nbytes), *plan.shape)
    values = flat.view(int(plan.lengths.sum()), *plan.rest)
    offsets = torch.zeros(len(plan.lengths) + 1, dtype=torch.int64)
    torch.cumsum(torch.from_numpy(plan.lengths), 0, out=offsets[1:])
    return jagged(values, offsets, plan.lengths)


def _read_file_rows(values) -> None:
    """Turn the rows of ``values`` that are in reply files into RawTensors of their own."""
    keep = []
    for pos, src in values.chunks:
        if not isinstance(src, shm.FileRows):
            keep.append((pos, src))
            continue
        size = DTYPE_SIZES[src.dtype]
        lengths = [prod(s) * size for s in src.shapes]
        want = sum(lengths)
        data = fsutil.pread_exact(src.file.fd, want, src.offset)
        if len(data) != want:
            raise OSError(f"reply file ended after {len(data)} of {want} bytes")
        view, at = memoryview(data), 0
        for p, shape, nb in zip(pos, src.shapes, lengths):
            values[p] = RawTensor.of(src.dtype, tuple(shape), view[at:at + nb])
            at += nb
    values.chunks = keep


_PARALLEL_BYTES = 8 << 20  # smaller columns are read by the calling thread
_pool = None
_pool_lock = threading.Lock()


def _reader_pool():
    """Threads that read reply files into a result (first touch of fresh memory is the
    cost, and it runs in parallel with the GIL released)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor
            _pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                       thread_name_prefix="tqtx-get-read")
        return _pool


def _assemble_direct(values, files):
    """A tensor column some of whose rows are in reply files, read with ``preadv``
    straight into the result (laid out as for a get copied in: :mod:`tqtx.client.result_layout`);
    None if the rows do not make one dense or jagged tensor of one dtype."""
    n, dtype = len(values), files[0][1].dtype
    parts = []
    for pos, src in files:
        if src.dtype != dtype:
            return None
        parts.append((pos, src.shapes))
    mem = [i for i, v in enumerate(values) if v is not None]
    if any(type(values[i]) is not RawTensor or values[i].dtype != dtype for i in mem):
        return None
    parts.append((mem, [values[i].shape for i in mem]))
    table = result_layout.shape_table(parts, n) if dtype in _TORCH_DTYPES else None
    if table is None:
        return None
    plan = result_layout.ColumnPlan(dtype, table)
    plan.open(result_buffer)
    if plan.total:
        dst = memoryview(plan.view)
        reads = []
        for pos, src in files:
            idx = np.asarray(pos, dtype=np.int64)
            reads.append((src.file.fd, [dst[a:a + b] for a, b in zip(
                plan.starts[idx].tolist(), plan.nbytes[idx].tolist()) if b], src.offset))
        if len(reads) > 1 and plan.total >= _PARALLEL_BYTES:
            list(_reader_pool().map(lambda r: fsutil.preadv_all(*r), reads))  # drops the GIL
        else:
            for r in reads:
                fsutil.preadv_all(*r)
        plan.fill(mem, [values[i] for i in mem])
    return _from_plan(plan)


def close_files_later(files: list) -> None:
    """Close reply files off the caller's thread: closing the last reference to a file in
    a RAM file system frees its pages, which takes a while for a large get."""
    if files:
        _reader_pool().submit(lambda: [f.close() for f in files])


def assemble_column(values: list, schema: dict):
    """Build a batch column: dense tensor, jagged nested tensor or NonTensorStack."""
    plan = getattr(values, "plan", None)
    if plan is not None:
        return _from_plan(plan)
    files = [c for c in getattr(values, "chunks", ()) if isinstance(c[1], shm.FileRows)]
    if files:
        col = _assemble_direct(values, files)
        if col is not None:
            return col
        _read_file_rows(values)
    if schema.get("kind") != "tensor" or not values or not isinstance(values[0], RawTensor):
        return NonTensorStack(*[decode_field_object(v) for v in values]) if values else None
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
        return jagged(flat, offsets, lengths)
    return torch.nested.nested_tensor([from_raw(v) for v in values])


def _transferqueue_layout(col):
    """A column as TransferQueue 0.1.11 returns it (its storage manager's packing): rows
    of one or more dimensions as a jagged nested tensor even when their shapes agree (for
    a dense column a view of it, no copy), 0-d rows as one dense tensor, other values as a
    NonTensorStack; a non-tensor column whose rows are all tensors is packed like tensors."""
    if isinstance(col, NonTensorStack):
        rows = col.tolist()
        if rows and all(isinstance(r, torch.Tensor) for r in rows):
            return pack_tensor_rows(rows)
        return col
    if not isinstance(col, torch.Tensor) or col.dim() < 2 or col.is_nested:
        return col
    n, length = col.shape[0], col.shape[1]
    values = col.reshape(n * length, *col.shape[2:])
    offsets = torch.arange(n + 1, dtype=torch.int64) * length
    return jagged(values, offsets, (length,) if n else ())


def pack_tensor_rows(rows: list):
    """Per-row tensors packed as TransferQueue packs them: all 0-d stacked dense, else a
    jagged nested tensor, else a strided one, else a NonTensorStack. Rows of different
    dtypes stay a NonTensorStack (TransferQueue's strided fallback would convert them all
    to the first row's dtype)."""
    if len({r.dtype for r in rows}) > 1:
        return NonTensorStack(*rows)
    if all(r.dim() == 0 for r in rows):
        return torch.stack(rows)
    for layout in (torch.jagged, torch.strided):
        try:
            return torch.nested.as_nested_tensor(rows, layout=layout)
        except (RuntimeError, TypeError, ValueError):
            continue
    return NonTensorStack(*rows)


def tensordict_from_columns(columns: dict, schemas: dict, n: int, *,
                            layout: str = "tqtx") -> TensorDict:
    """A batch from GET_ROWS columns. ``layout="transferqueue"``: tensor fields come back
    nested (jagged) as in TransferQueue, even with uniform shapes; default: dense then."""
    out = {}
    for field, values in columns.items():
        col = assemble_column(values, schemas.get(field, {}))
        if col is None:
            continue
        if layout == "transferqueue":
            col = _transferqueue_layout(col)
        out[field] = col
    return batches.batch(out, n)
