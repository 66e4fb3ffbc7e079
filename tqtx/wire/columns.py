"""Integer columns as raw little-endian int64 bytes: per-row metadata (global indexes,
field-set numbers) crosses the wire without per-element msgpack work on either side."""
from __future__ import annotations

import sys
from array import array

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
