"""Torch-free value model shared by every process.

Controller and storage units never import torch: a tensor is a :class:`RawTensor`
(dtype name, shape, raw little-endian bytes). Non-tensor values are plain
msgpack-able Python objects that may contain RawTensors.
"""
from __future__ import annotations

from math import prod

# dtype name -> item size in bytes. Names are torch's without the "torch." prefix.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# A decoded tensor header is a new dtype str (~60 bytes) and shape tuple (48 bytes for 1-D,
# plus 32 per int over 256) per tensor: a process holding many rows shares equal ones.
DTYPE_NAMES: dict[str, str] = {name: name for name in DTYPE_SIZES}  # name -> one str object
_SHAPES: dict = {}
_SHAPES_MAX = 1024


def shared_shape(shape: tuple) -> tuple:
    """An equal shape tuple already in use if one is known (bounded cache), else ``shape``."""
    got = _SHAPES.get(shape)
    if got is None:
        if len(_SHAPES) >= _SHAPES_MAX:
            _SHAPES.clear()
        _SHAPES[shape] = got = shape
    return got


def forget_shapes() -> None:
    """Drop the shared shapes (a storage unit that holds no rows any more: the cached
    tuples, made amid the rows' objects, would keep their memory pages alive)."""
    _SHAPES.clear()


class RawTensor:
    """A tensor as header + bytes: ``dtype`` name, ``shape`` tuple and a buffer ``data``.

    ``data`` is any object supporting the buffer protocol (bytes, bytearray, memoryview,
    zmq frame buffer) holding exactly ``nbytes`` bytes in C order.
    """

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: str, shape, data):
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.data = data

    @classmethod
    def of(cls, dtype: str, shape: tuple, data) -> "RawTensor":
        """A RawTensor from a ``shape`` that already is a tuple of ints (no conversion: for
        hot loops over rows whose header was checked as a whole, e.g. a packed column)."""
        t = object.__new__(cls)
        t.dtype, t.shape, t.data = dtype, shape, data
        return t

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_SIZES[self.dtype]

    def validate(self, where: str = "tensor") -> None:
        """Raise ValueError if the header is unknown or does not match the byte count."""
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"{where}: unknown dtype {self.dtype!r}")
        if any(s < 0 for s in self.shape):
            raise ValueError(f"{where}: negative dimension in shape {self.shape}")
        got = memoryview(self.data).nbytes
        if got != self.nbytes:
            raise ValueError(
                f"{where}: {got} bytes for dtype {self.dtype} shape {list(self.shape)} "
                f"(expected {self.nbytes})")

    def compact(self) -> "RawTensor":
        """Return a RawTensor owning a private copy of exactly its own bytes."""
        return RawTensor.of(self.dtype, self.shape, bytes(self.data))

    def __eq__(self, other):
        return (isinstance(other, RawTensor) and self.dtype == other.dtype
                and self.shape == other.shape and bytes(self.data) == bytes(other.data))

    def __repr__(self):
        return f"RawTensor({self.dtype}, {list(self.shape)})"


class TensorColumn:
    """The rows of one tensor field of a batch, all of one dtype, encoded under one header
    (:mod:`tqtx.wire.codec`): a put of thousands of rows then costs one header per field,
    not one per row and field. It decodes to the plain list of its rows' RawTensors."""

    __slots__ = ("dtype", "rows")

    def __init__(self, dtype: str, rows: list):
        self.dtype = dtype
        self.rows = rows

    @staticmethod
    def of_rows(rows: list):
        """A TensorColumn of ``rows`` if each is a RawTensor of one dtype, else None."""
        if not rows or type(rows[0]) is not RawTensor:
            return None
        dtype = rows[0].dtype
        for r in rows:
            if type(r) is not RawTensor or r.dtype != dtype:
                return None
        return TensorColumn(dtype, rows)


def value_nbytes(value) -> int:
    """Payload bytes of a stored value (tensor bytes, plus tensors nested in objects)."""
    if isinstance(value, RawTensor):
        return value.nbytes
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(value_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(value_nbytes(v) for v in value.values())
    return 8


def row_nbytes(row: dict) -> int:
    """Payload bytes of a stored row (its values' :func:`value_nbytes`)."""
    n = 0
    for v in row.values():  # tensors inline: every row a unit stores or drops comes here
        if type(v) is RawTensor:
            n += prod(v.shape) * DTYPE_SIZES[v.dtype]
        else:
            n += value_nbytes(v)
    return n
