"""The wire codec (tqtx/wire/codec.py): msgpack header + raw tensor frames, never pickle."""
from __future__ import annotations

import pickle
import subprocess
import sys

import msgpack
import pytest

from tqtx.wire.codec import (EXT_TENSOR_COLUMN, EXT_TENSOR_FRAME, EXT_TENSOR_INLINE,
                             INLINE_LIMIT, CodecError, decode, encode, packb, unpackb)
from tqtx.wire.columns import rows_of_columns
from tqtx.wire.values import DTYPE_SIZES, RawTensor, TensorColumn, value_nbytes


def _frames_as_bytes(frames):
    return [bytes(memoryview(f)) for f in frames]


def test_round_trip_plain_values():
    msg = {"op": "PUT", "n": 3, "f": 1.5, "b": b"\x00\xff", "s": "héllo", "none": None,
           "t": True, "list": [1, [2, {"x": "y"}]], "neg": -7, "big": 2 ** 62}
    frames = encode(msg)
    assert len(frames) == 1
    assert decode(_frames_as_bytes(frames)) == msg


def test_small_tensor_inline_large_tensor_own_frame():
    small = RawTensor("float32", (4,), bytes(16))
    big_data = bytes(range(256)) * ((INLINE_LIMIT // 256) + 1)
    big = RawTensor("uint8", (len(big_data),), big_data)
    frames = encode({"rows": [small, {"nested": big}]})
    assert len(frames) == 2  # header + one frame for the big tensor only
    assert memoryview(frames[1]).nbytes == len(big_data)
    out = decode(_frames_as_bytes(frames))
    assert out["rows"][0] == small
    assert out["rows"][1]["nested"] == big
    assert out["rows"][1]["nested"].shape == (len(big_data),)


def test_tensor_exactly_at_inline_limit_is_inline():
    t = RawTensor("uint8", (INLINE_LIMIT,), bytes(INLINE_LIMIT))
    assert len(encode([t])) == 1
    t2 = RawTensor("uint8", (INLINE_LIMIT + 1,), bytes(INLINE_LIMIT + 1))
    assert len(encode([t2])) == 2


def test_frame_is_sent_without_copy():
    buf = bytearray(INLINE_LIMIT * 2)
    t = RawTensor("uint8", (len(buf),), memoryview(buf))
    frames = encode([t])
    buf[0] = 42  # the frame views the caller's buffer
    assert memoryview(frames[1])[0] == 42


def test_frame_is_only_the_rows_bytes_for_a_slice_of_a_big_buffer():
    big = bytearray(1 << 20)
    n = INLINE_LIMIT + 904  # a frame of its own
    row = memoryview(big)[8192:8192 + n]
    frames = encode([RawTensor("uint8", (n,), row)])
    assert memoryview(frames[1]).nbytes == n
    out = decode(_frames_as_bytes(frames))
    assert memoryview(out[0].data).nbytes == n


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_every_dtype_round_trips(dtype):
    shape = (2, 3)
    n = 6 * DTYPE_SIZES[dtype]
    t = RawTensor(dtype, shape, bytes(range(n)))
    assert decode(_frames_as_bytes(encode({"t": t})))["t"] == t
    assert unpackb(packb({"t": t}))["t"] == t


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1, 1, 1, 1)])
def test_scalar_and_zero_length_shapes(shape):
    nbytes = RawTensor("int64", shape, b"").nbytes
    t = RawTensor("int64", shape, bytes(nbytes))
    out = decode(_frames_as_bytes(encode([t])))[0]
    assert out.shape == shape and out == t


def test_packb_is_self_contained():
    big = RawTensor("uint8", (INLINE_LIMIT * 3,), bytes(INLINE_LIMIT * 3))
    data = packb({"x": big, "s": {1, 2}})
    assert isinstance(data, bytes)
    out = unpackb(data)
    assert out["x"] == big
    assert out["s"] == [1, 2]


def test_non_msgpackable_value_is_refused_not_pickled():
    class Thing:
        pass
    with pytest.raises(TypeError, match="Thing"):
        encode({"x": Thing()})
    with pytest.raises(TypeError):
        packb([object()])


def test_unknown_extension_type_is_refused():
    # An ext type that is not one of ours, e.g. something claiming to be a pickle.
    evil = msgpack.packb({"x": msgpack.ExtType(7, pickle.dumps([1, 2]))}, use_bin_type=True)
    with pytest.raises(CodecError, match="unknown extension type 7"):
        decode([evil])
    with pytest.raises(CodecError):
        unpackb(evil)


def test_decode_does_not_unpickle():
    payload = pickle.dumps({"a": 1})
    with pytest.raises(CodecError):
        decode([payload + b"\xc1"])  # garbage / pickle bytes are not a msgpack message


def test_tensor_header_must_match_bytes():
    bad = msgpack.packb(msgpack.ExtType(EXT_TENSOR_INLINE, msgpack.packb(
        ["float32", [4], b"\x00" * 15], use_bin_type=True)), use_bin_type=True)
    with pytest.raises(CodecError, match="expected 16"):
        decode([bad])


def test_unknown_dtype_and_negative_shape_refused():
    for dtype, shape in [("float128", [1]), ("object", [1])]:
        bad = msgpack.packb(msgpack.ExtType(EXT_TENSOR_INLINE, msgpack.packb(
            [dtype, shape, b"\x00" * 16], use_bin_type=True)), use_bin_type=True)
        with pytest.raises(CodecError, match="unknown dtype"):
            decode([bad])
    bad = msgpack.packb(msgpack.ExtType(EXT_TENSOR_INLINE, msgpack.packb(
        ["uint8", [-1], b""], use_bin_type=True)), use_bin_type=True)
    with pytest.raises(CodecError, match="negative"):
        decode([bad])


def test_frame_reference_must_exist():
    bad = msgpack.packb(msgpack.ExtType(EXT_TENSOR_FRAME, msgpack.packb(
        ["uint8", [4], 1], use_bin_type=True)), use_bin_type=True)
    with pytest.raises(CodecError, match="missing frame"):
        decode([bad])
    bad0 = msgpack.packb(msgpack.ExtType(EXT_TENSOR_FRAME, msgpack.packb(
        ["uint8", [4], 0], use_bin_type=True)), use_bin_type=True)
    with pytest.raises(CodecError, match="missing frame"):
        decode([bad0, b"abcd"])
    ok = msgpack.packb(msgpack.ExtType(EXT_TENSOR_FRAME, msgpack.packb(
        ["uint8", [4], 1], use_bin_type=True)), use_bin_type=True)
    assert decode([ok, b"abcd"]).shape == (4,)
    with pytest.raises(CodecError, match="expected 4"):
        decode([ok, b"abc"])


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\x92\x01", b"\xdb\xff\xff\xff\xff"])
def test_malformed_messages_raise_codec_error(garbage):
    with pytest.raises(CodecError):
        decode([garbage])


def test_empty_message_refused():
    with pytest.raises(CodecError, match="empty"):
        decode([])


def test_malformed_tensor_ext_payload():
    bad = msgpack.packb(msgpack.ExtType(EXT_TENSOR_INLINE, b"\x01"), use_bin_type=True)
    with pytest.raises(CodecError, match="malformed tensor header"):
        decode([bad])
    bad2 = msgpack.packb(msgpack.ExtType(EXT_TENSOR_INLINE, msgpack.packb(
        [1, [4], b"\x00" * 4], use_bin_type=True)), use_bin_type=True)
    with pytest.raises(CodecError):
        decode([bad2])


def _column_rows():
    big = bytearray(range(256)) * ((INLINE_LIMIT // 256) + 2)
    return [RawTensor("int32", (3,), bytes(range(12))),
            RawTensor("int32", (len(big) // 4,), memoryview(big)),
            RawTensor("int32", (0,), b""),
            RawTensor("int32", (2, 2), bytes(range(100, 116)))]


def test_tensor_column_round_trips_as_its_rows():
    rows = _column_rows()
    frames = encode({"cols": {"x": TensorColumn("int32", rows)}, "n": 4})
    assert len(frames) == 2  # the header, and one frame: the row over INLINE_LIMIT
    out = decode(_frames_as_bytes(frames))
    assert out["n"] == 4 and out["cols"]["x"] == rows
    small = out["cols"]["x"][0]
    assert type(small.data) is bytes and len(small.data) == 12  # owns exactly its bytes
    assert unpackb(packb(TensorColumn("int32", rows))) == rows  # self-contained form


def test_tensor_column_of_rows_needs_one_dtype():
    rows = _column_rows()
    assert TensorColumn.of_rows(rows).rows is rows
    assert TensorColumn.of_rows(rows + [RawTensor("int64", (1,), bytes(8))]) is None
    assert TensorColumn.of_rows(rows + ["text"]) is None
    assert TensorColumn.of_rows([]) is None


def _bad_column(payload) -> bytes:
    return msgpack.packb(msgpack.ExtType(EXT_TENSOR_COLUMN, msgpack.packb(
        payload, use_bin_type=True)), use_bin_type=True)


@pytest.mark.parametrize("payload, frames, match", [
    (["float128", [[1]], [0], b"\x00"], [], "unknown dtype"),
    (["uint8", [[2]], [0, 0], b"\x00\x00"], [], "malformed tensor column header"),
    (["uint8", [[-1]], [0], b""], [], "malformed shape"),
    (["uint8", [[4]], [0], b"\x00\x00"], [], "more bytes"),
    (["uint8", [[1]], [0], b"\x00\x00"], [], "left over"),
    (["uint8", [[4]], [1], b""], [], "missing or not of its 4 bytes"),
    (["uint8", [[4]], [1], b""], [b"abc"], "missing or not of its 4 bytes"),
    (["uint8", [[4]], [-1], b""], [b"abcd"], "missing or not"),
    (b"\x01", [], "malformed tensor column"),
])
def test_hostile_tensor_columns_are_refused(payload, frames, match):
    header = (_bad_column(payload) if isinstance(payload, list) else
              msgpack.packb(msgpack.ExtType(EXT_TENSOR_COLUMN, payload), use_bin_type=True))
    with pytest.raises(CodecError, match=match):
        decode([header, *frames])


def test_rows_of_columns_checks_every_field_has_every_row():
    assert rows_of_columns([7, 9], {"a": [1, 2], "b": ["x", "y"]}) == [
        (7, {"a": 1, "b": "x"}), (9, {"a": 2, "b": "y"})]
    with pytest.raises(ValueError, match="field 'b' has 1 rows for 2 indexes"):
        rows_of_columns([7, 9], {"a": [1, 2], "b": ["x"]})
    with pytest.raises(ValueError, match="idx must be a list"):
        rows_of_columns(None, {})


def test_codec_error_is_value_error():
    assert issubclass(CodecError, ValueError)


def test_int_map_keys_allowed():
    assert decode(_frames_as_bytes(encode({1: "a", 2: "b"}))) == {1: "a", 2: "b"}


def test_value_nbytes():
    assert value_nbytes(RawTensor("float32", (2, 3), bytes(24))) == 24
    assert value_nbytes([RawTensor("uint8", (5,), bytes(5)), b"abc"]) == 8


_CHURN_PROBE = """
import resource
from tqtx.wire.codec import encode, packb
from tqtx.wire.values import RawTensor
reply = {"rid": "a" * 32, "ok": True, "result": {"bytes": 16384, "stale": []}}
request = {"op": "PUT_ROWS", "rid": "b" * 32,
           "body": {"cols": {"x": RawTensor("float32", (16,), bytes(64))}}}
tag = {"score": RawTensor("float32", (4,), bytes(16))}
for how, msg in ((encode, reply), (encode, request), (packb, tag)):
    for _ in range(100):  # the heap settles
        how(msg)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(2000):
        how(msg)
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RUSAGE_THREAD, glibc")
def test_encoding_does_not_churn_the_heap():
    """Encoding small messages (and packing a value holding a tensor) in a fresh process (a
    server's) touches no fresh page: two Packers with 1 MiB buffers freed together would
    make glibc hand its heap top back and fault it in again every time (two page faults
    and three brk calls each)."""
    out = subprocess.run([sys.executable, "-c", _CHURN_PROBE], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert [int(x) < 200 for x in out] == [True, True, True], out
