"""schema.validate_row with a location made only on failure (the restore path's per-record
check) says exactly what it says with the location given as a string."""
from __future__ import annotations

import pytest

from tqtx.errors import DumpFormatError
from tqtx.schema import validate_row
from tqtx.wire.values import RawTensor

SCHEMA = {
    "x": {"kind": "tensor", "dtype": "float32", "shape": [4], "jagged": False, "ndim": 1},
    "j": {"kind": "tensor", "dtype": "int64", "shape": None, "jagged": True, "ndim": 2},
    "o": {"kind": "object"},
    "odd": {"kind": "tensor", "dtype": "nope", "shape": [1], "jagged": False, "ndim": 1},
}


def _t(dtype, shape, nbytes=None):
    size = {"float32": 4, "int64": 8, "float64": 8}[dtype]
    n = size
    for s in shape:
        n *= s
    return RawTensor.of(dtype, tuple(shape), memoryview(bytes(n if nbytes is None else nbytes)))


ROWS = [
    {"x": _t("float32", [4]), "j": _t("int64", [2, 3]), "o": {"a": 1}},
    {"x": _t("float32", [5])},                    # shape differs from a fixed shape
    {"x": _t("float64", [4])},                    # dtype
    {"x": _t("float32", [2, 2])},                 # ndim
    {"x": _t("float32", [4], nbytes=12)},         # byte count
    {"x": [1, 2]},                                # not a tensor
    {"o": _t("float32", [1])},                    # tensor in an object field
    {"y": 1},                                     # not in the schema
    {"odd": _t("float32", [1])},                  # malformed schema entry
    {"j": _t("int64", [7, 1])},
]


@pytest.mark.parametrize("row", ROWS)
def test_a_lazy_location_gives_the_same_error(row):
    where = "f.bin record of global index 3"
    try:
        validate_row(row, SCHEMA, where=where)
        expected = None
    except DumpFormatError as exc:
        expected = str(exc)
    made = []

    def location():
        made.append(1)
        return where

    try:
        validate_row(row, SCHEMA, where=location)
        got = None
    except DumpFormatError as exc:
        got = str(exc)
    assert got == expected
    assert len(made) == (0 if expected is None else 1)  # made only for a row that fails
