"""Columns on the wire: integer columns as raw little-endian int64 bytes (per-row metadata,
global indexes and field-set numbers, crosses without per-element msgpack work on either
side), and the rows of a GET_ROWS reply column."""
from __future__ import annotations

import sys
from array import array
from math import prod

from .values import DTYPE_SIZES, RawTensor

_SWAP = sys.byteorder != "little"
NUMPY_DTYPE = "<i8"  # the same layout, for callers that hold the column as a numpy array


def pack_int64(values) -> bytes:
    """``values`` (ints) as little-endian int64 bytes."""
    out = array("q", values)
    if _SWAP:
        out.byteswap()
    return out.tobytes()


def unpack_int64(column) -> "array | list":
    """A column sent either way: packed bytes (see :func:`pack_int64`) or a list of ints."""
    if not isinstance(column, (bytes, bytearray, memoryview)):
        return column
    out = array("q")
    if len(column) % out.itemsize:
        raise ValueError(f"an int64 column of {len(column)} bytes (not a multiple of 8)")
    out.frombytes(column)
    if _SWAP:
        out.byteswap()
    return out


def unpack_column(col: dict) -> list:
    """Per-row values of a GET_ROWS reply column (views into a packed buffer, no copy)."""
    if "v" in col:
        return col["v"]
    dtype, shapes, buf = col["p"]
    view = memoryview(buf.data)
    size = DTYPE_SIZES[dtype]
    out, at = [], 0
    new = RawTensor.of  # per row and field: the checking constructor cost 0.04-0.12 s per 30k
    for shape in shapes:
        shape = tuple(shape)
        n = prod(shape) * size
        out.append(new(dtype, shape, view[at:at + n]))
        at += n
    if at != view.nbytes:
        raise ValueError(f"packed column of {view.nbytes} bytes does not match its "
                         f"{len(shapes)} row shapes ({at} bytes)")
    return out


def rows_of_columns(indexes: list, columns: dict) -> list:
    """``[(index, {field: value})]`` of a put sent as columns (``columns``: field -> the
    rows' values, in the order of ``indexes``)."""
    if not isinstance(indexes, list) or not isinstance(columns, dict):
        raise ValueError("PUT_ROWS: idx must be a list and cols a map of field to rows")
    names = list(columns)
    values = [columns[f] for f in names]
    for f, v in zip(names, values):
        if not isinstance(v, list) or len(v) != len(indexes):
            raise ValueError(f"PUT_ROWS: field {f!r} has "
                             f"{len(v) if isinstance(v, list) else 'no list of'} rows "
                             f"for {len(indexes)} indexes")
    return [(idx, dict(zip(names, row))) for idx, *row in zip(indexes, *values)]
