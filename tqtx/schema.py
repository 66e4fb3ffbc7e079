"""Field schemas: infer them from values, merge them, check compatibility, validate rows.

A field schema is ``{"kind": "object"}`` or ``{"kind": "tensor", "dtype", "shape", "jagged",
"ndim"}`` (``shape`` None when rows differ in shape, then ``jagged`` is True). Torch-free:
the controller, storage units and the dump format use it.

A put's schema may say ``"mixable": True`` (TransferQueue's semantics, the default): then a
field that holds tensor values takes non-tensor values in a later put, and the reverse, as
TransferQueue accepts them. The field becomes ``{"kind": "object", "mixed": True}``: its rows
keep what they were put as (a bare tensor row stays one). Without the flag (strict mode,
restores) a change of kind is a SchemaConflictError.
"""
from __future__ import annotations

from math import prod

from tqtx.errors import DumpFormatError, SchemaConflictError
from tqtx.wire.values import DTYPE_SIZES, RawTensor


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------ inferring

def column_schema(values: list) -> dict:
    """Field schema of one batch column of RawTensors or objects (no values: object).

    Assumes the tensors share one dtype (the client stores mixed ones as objects).
    """
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


def infer_schema(values: list) -> dict:
    """Field schema of a non-empty list of values of one field.

    All RawTensors → ``{"kind": "tensor", ...}`` (same dtype and ndim required; differing
    shapes give ``shape=None, jagged=True``); no RawTensor → ``{"kind": "object"}``.
    Raises ValueError for mixed kinds, dtypes or ndims.
    """
    if not values:
        raise ValueError("cannot infer a field schema from no values")
    first = values[0]
    if not isinstance(first, RawTensor):
        if any(isinstance(v, RawTensor) for v in values):
            raise ValueError("field mixes tensor and non-tensor values")
        return {"kind": "object"}
    dtype, shape = first.dtype, first.shape
    ndim = len(shape)
    jagged = False
    for v in values:
        if not isinstance(v, RawTensor):
            raise ValueError("field mixes tensor and non-tensor values")
        if v.dtype != dtype:
            raise ValueError(f"field mixes dtypes {dtype} and {v.dtype}")
        if v.shape != shape:
            if len(v.shape) != ndim:
                raise ValueError(f"field mixes tensors of {ndim} and {len(v.shape)} dimensions")
            jagged = True
    return {"kind": "tensor", "dtype": dtype, "shape": None if jagged else list(shape),
            "jagged": jagged, "ndim": ndim}


# ------------------------------------------------------------------ merging

def check_schema_compatible(field: str, old: dict, new: dict) -> None:
    """Raise SchemaConflictError (a ValueError and a RuntimeError) if ``new`` rows of
    ``field`` cannot join rows described by ``old`` (a change of kind is allowed when
    ``new`` is ``mixable``; a tensor field's dtype and rank never change)."""
    if old["kind"] != new["kind"] or old.get("mixed"):
        if new.get("mixable"):
            return
        if old.get("mixed"):
            if new["kind"] == "object":
                return
            raise SchemaConflictError(
                f"field {field!r}: dtype mismatch: it holds mixed tensor and non-tensor "
                f"values; only non-tensor values can join them here")
        raise SchemaConflictError(
            f"field {field!r}: dtype mismatch: it holds {old['kind']} values; cannot store "
            f"{new['kind']} values in it")
    if old["kind"] == "tensor":
        if old["dtype"] != new["dtype"]:
            raise SchemaConflictError(
                f"field {field!r}: dtype mismatch: it has dtype {old['dtype']}; got "
                f"{new['dtype']} (a field's dtype cannot change)")
        if old.get("ndim") != new.get("ndim"):
            raise SchemaConflictError(
                f"field {field!r}: schema conflict: it has {old.get('ndim')}-d rows; got "
                f"{new.get('ndim')}-d rows")


def merge_schema(old: dict | None, new: dict) -> dict:
    """The schema describing rows of both ``old`` (None: a new field) and ``new``.

    Checks nothing: call :func:`check_schema_compatible` first. Returns ``old`` itself
    when it already covers ``new``. Kinds that differ make a mixed object field.
    """
    if old is None:
        return {k: v for k, v in new.items() if k != "mixable"}
    if old["kind"] != new["kind"]:
        return dict(MIXED)
    if old["kind"] != "tensor":
        return old
    if old.get("shape") is not None and old.get("shape") == new.get("shape"):
        return old
    return {**old, "shape": None, "jagged": True}


MIXED = {"kind": "object", "mixed": True}


def merge_schema_strict(a: dict, b: dict) -> dict:
    """Schema covering the values of both ``a`` and ``b``; ValueError if incompatible."""
    if a["kind"] != b["kind"]:
        raise ValueError(f"field mixes {a['kind']} and {b['kind']} values")
    if a["kind"] != "tensor":
        return dict(a)
    if a["dtype"] != b["dtype"]:
        raise ValueError(f"field mixes dtypes {a['dtype']} and {b['dtype']}")
    if a["ndim"] != b["ndim"]:
        raise ValueError(f"field mixes tensors of {a['ndim']} and {b['ndim']} dimensions")
    jagged = bool(a.get("jagged") or b.get("jagged") or a.get("shape") != b.get("shape"))
    return {"kind": "tensor", "dtype": a["dtype"], "shape": None if jagged else list(a["shape"]),
            "jagged": jagged, "ndim": a["ndim"]}


# ------------------------------------------------------------------ validating

def field_schema_problem(schema) -> str | None:
    """What is malformed in a stored ``{field: field schema}`` map, or None if nothing."""
    if not isinstance(schema, dict):
        return "field_schema is not a map"
    for name, fs in schema.items():
        if not isinstance(name, str) or not isinstance(fs, dict):
            return f"malformed field schema for {name!r}"
        kind = fs.get("kind")
        if kind == "object":
            continue
        if kind != "tensor":
            return f"field {name!r} has unknown schema kind {kind!r}"
        shape = fs.get("shape")
        dtype = fs.get("dtype")
        if (type(dtype) is not str or dtype not in DTYPE_SIZES or not _is_int(fs.get("ndim"))
                or not isinstance(fs.get("jagged"), bool)
                or not (shape is None or (isinstance(shape, list)
                                          and all(_is_int(s) and s >= 0 for s in shape)))
                or (shape is not None and len(shape) != fs["ndim"])
                or (shape is None and not fs["jagged"])):
            return f"malformed tensor schema for field {name!r}: {fs!r}"
    return None


def validate_row(row: dict, schema: dict, *, where) -> None:
    """Check every value of ``row`` against ``schema`` ({field: field schema});
    DumpFormatError naming ``where``: a str, or a callable making it (called only for a
    row that fails, so a restore does not format a location per record)."""
    for name, value in row.items():
        fs = schema.get(name)
        if fs is None:
            _fail(where, f"field {name!r} is not in the dump's field schema")
        kind = fs.get("kind")
        if kind == "object":
            if isinstance(value, RawTensor) and not fs.get("mixed"):
                _fail(where, f"field {name!r} holds a tensor, schema says object")
            continue
        if kind != "tensor":
            _fail(where, f"field {name!r} has unknown schema kind {kind!r}")
        if not isinstance(value, RawTensor):
            _fail(where, f"field {name!r} holds a {type(value).__name__}, schema says tensor")
        if value.dtype != fs.get("dtype"):
            _fail(where, f"field {name!r} has dtype {value.dtype}, "
                         f"schema says {fs.get('dtype')}")
        if len(value.shape) != fs.get("ndim"):
            _fail(where, f"field {name!r} has {len(value.shape)} dimensions, "
                         f"schema says {fs.get('ndim')}")
        if not fs.get("jagged") and fs.get("shape") is not None \
                and list(value.shape) != list(fs["shape"]):
            _fail(where, f"field {name!r} has shape {list(value.shape)}, "
                         f"schema says {list(fs['shape'])}")
        itemsize = DTYPE_SIZES.get(value.dtype)
        expected = prod(value.shape) * itemsize if itemsize else -1
        if memoryview(value.data).nbytes != expected:
            _fail(where, f"field {name!r} has {memoryview(value.data).nbytes} bytes, "
                         f"expected {expected}")


def _fail(where, problem: str):
    raise DumpFormatError(f"{where() if callable(where) else where}: {problem}")
