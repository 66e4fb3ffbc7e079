"""A record's bytes are exactly what the format says (tqtx.format.records' docstring):
``b"TQR2" + uint32_le(len(header)) + header + payloads``, the header one msgpack map
``{"i", "g", "p", "k", "f"}`` with every field in row order, the payloads of at most 4 KiB
first and the larger ones after them, each in row order. Checked against a reference built
here from the format's words, for rows of every value kind and size."""
from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tqtx import format as F
from tqtx.format.records import RecordEncoder, encode_record_parts
from tqtx.wire import codec
from tqtx.wire.values import DTYPE_SIZES, RawTensor

SMALL = 4096  # payloads up to this size come first


def reference(gidx: int, row: dict, gen: int, pid: str, key: str) -> bytes:
    tensors = [(n, v) for n, v in row.items() if isinstance(v, RawTensor)]
    small = [(n, v) for n, v in tensors if len(v.data) <= SMALL]
    large = [(n, v) for n, v in tensors if len(v.data) > SMALL]
    offsets, at = {}, 0
    for name, v in small + large:
        offsets[name] = at
        at += len(v.data)
    specs = {}
    for name, v in row.items():
        if isinstance(v, RawTensor):
            specs[name] = ["t", v.dtype, list(v.shape), offsets[name], len(v.data)]
        else:
            specs[name] = ["o", codec.packb(v)]
    header = msgpack.packb({"i": gidx, "g": gen, "p": pid, "k": key, "f": specs},
                           use_bin_type=True)
    return b"".join([b"TQR2", struct.pack("<I", len(header)), header,
                     *(bytes(v.data) for _, v in small + large)])


DTYPES = sorted(DTYPE_SIZES)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 40), max_size=3)))
    if draw(st.booleans()) and shape:  # some rows past the 4 KiB line
        shape = (draw(st.integers(1, 3000)),) + shape[1:]
    n = DTYPE_SIZES[dtype]
    for s in shape:
        n *= s
    data = bytes(i % 251 for i in range(n))
    as_view = draw(st.booleans())
    return RawTensor(dtype, shape, memoryview(bytearray(data)) if as_view else data)


objects = st.one_of(st.none(), st.integers(-2**40, 2**40), st.text(max_size=20),
                    st.lists(st.integers(0, 9), max_size=4),
                    st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**63 - 1), max_size=3))


@settings(max_examples=150, deadline=None)
@given(fields=st.lists(st.tuples(st.text(min_size=1, max_size=12),
                                 st.one_of(tensors(), objects)), max_size=20),
       gidx=st.integers(0, 2**40), gen=st.integers(0, 2**62),
       pid=st.text(max_size=10), key=st.text(max_size=30),
       mode=st.sampled_from(["fresh", "reused", "jagged"]))
def test_a_record_is_the_format_s_bytes(fields, gidx, gen, pid, key, mode):
    """Both ways of packing a header: its pieces joined (a fresh encoder; a reused one
    that has the row's field layouts cached) and one dict (fields the encoder found
    jagged)."""
    row = dict(fields)
    encoder = None if mode == "fresh" else RecordEncoder()
    if mode == "jagged":
        encoder.jagged.update(row)
    for _ in range(1 if mode == "fresh" else 2):  # a reused encoder keeps nothing of a row
        head, large, length = encode_record_parts(gidx, row, encoder, gen=gen,
                                                  partition_id=pid, key=key)
        record = b"".join([head, *(bytes(b) for b in large)])
        assert record == reference(gidx, row, gen, pid, key)
        assert len(record) == length
    buffers, length, crc = F.encode_record(gidx, row, gen=gen, partition_id=pid, key=key)
    assert b"".join(bytes(b) for b in buffers) == record
    assert crc == F.checksum(record)


@pytest.mark.parametrize("row, error, text", [
    ({"x": RawTensor("float7", (2,), b"\0" * 8)}, ValueError, "field 'x': unknown dtype"),
    ({"x": RawTensor("int8", (2,), b"\0" * 3)}, ValueError, "field 'x': 3 bytes for dtype"),
    ({"x": RawTensor.of("int8", (-1,), b"")}, ValueError, "negative dimension in shape [-1]"),
    ({3: RawTensor("int8", (1,), b"\0")}, TypeError, "field names must be str, not 3"),
    ({3: "text"}, TypeError, "field names must be str, not 3"),
])
def test_a_value_the_format_cannot_hold_is_refused_naming_its_field(row, error, text):
    with pytest.raises(error, match="global index 5") as exc:
        encode_record_parts(5, row, gen=1, partition_id="p", key="k")
    assert text in str(exc.value)


@pytest.mark.parametrize("gen, pid, key", [(True, "p", "k"), (1.0, "p", "k"), (1, b"p", "k"),
                                           (1, "p", None)])
def test_a_record_names_its_row_by_an_int_generation_and_str_partition_and_key(gen, pid, key):
    with pytest.raises(TypeError, match="names its row by an int generation"):
        encode_record_parts(5, {}, gen=gen, partition_id=pid, key=key)


@pytest.mark.parametrize("sizes", [(4097, 4096, 1, 0), (4096, 4097), (2000, 2000, 5000, 3),
                                   (4095,) * 3, (0, 0)])
def test_payloads_of_at_most_4_kib_come_first(sizes):
    row = {f"f{i}": RawTensor("uint8", (n,), bytes((i + j) % 251 for j in range(n)))
           for i, n in enumerate(sizes)}
    row["note"] = {"step": 3}
    head, large, length = encode_record_parts(7, row, gen=2, partition_id="p", key="k")
    record = b"".join([head, *(bytes(b) for b in large)])
    assert record == reference(7, row, 2, "p", "k")
    header = msgpack.unpackb(record[8:8 + struct.unpack("<I", record[4:8])[0]])
    firsts = [spec[3] for spec in header["f"].values() if spec[0] == "t" and spec[4] <= SMALL]
    assert firsts == sorted(firsts) and (not firsts or firsts[0] == 0)


def test_a_field_whose_layouts_keep_missing_the_cache_is_packed_as_a_dict():
    encoder = RecordEncoder()
    for n in range(40):
        row = {"tokens": RawTensor("int64", (n + 1,), bytes(8 * (n + 1))),
               "reward": RawTensor("float32", (), bytes(4))}
        head, large, _ = encode_record_parts(n, row, encoder, gen=1, partition_id="p", key="k")
        assert b"".join([head, *(bytes(b) for b in large)]) == reference(n, row, 1, "p", "k")
    assert encoder.jagged == {"tokens"}
    assert len(encoder.fields) <= 20  # no layout cached once the field counts as jagged
