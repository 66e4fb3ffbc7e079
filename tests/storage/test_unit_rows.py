"""What a stored row costs: put rows and restored records share dtype names and shapes, and a
put tensor holds its frame rather than a view of it."""
from __future__ import annotations

import gc

import zmq

from tqtx import format as F
from tqtx.storage.memory import own_small_frames
from tqtx.wire import codec
from tqtx.wire.values import RawTensor


def _put_rows(n: int) -> list[dict]:
    """Rows as a unit decodes them from a PUT_ROWS message (fresh header objects each)."""
    rows = [{"a": RawTensor("int64", [300], bytes(2400)),
             "b": RawTensor("float32", [300], memoryview(bytearray(1200 * 6))[:1200]),
             "c": RawTensor("int64", [1000], bytes(8000)), "r": RawTensor("float32", [], bytes(4)),
             "s": "text"} for _ in range(n)]
    return [codec.decode(codec.encode(r)) for r in rows]


def test_put_rows_share_dtype_and_shape_objects():
    a, b = (own_small_frames(r) for r in _put_rows(2))
    assert a["a"].dtype is b["a"].dtype is a["c"].dtype and a["b"].dtype is b["b"].dtype
    assert a["a"].shape is b["a"].shape is a["b"].shape == (300,)
    assert a["c"].shape is b["c"].shape == (1000,) and a["r"].shape == ()
    # the 8000-byte frame is copied out of the receive buffer; values are unchanged
    assert type(a["c"].data) is bytes and a["c"] == RawTensor("int64", [1000], bytes(8000))
    assert a["s"] == "text" and bytes(a["b"].data) == bytes(1200)


def test_a_stored_put_frame_is_held_without_a_view_of_it():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://tqtx-test-unit-rows")
    b.connect("inproc://tqtx-test-unit-rows")
    try:
        big = bytes(range(256)) * 256  # 64 KiB: a frame of its own, not a shared buffer
        a.send_multipart(codec.encode({"x": RawTensor("uint8", [len(big)], big)}))
        row = own_small_frames(codec.decode(b.recv_multipart(copy=False)))
    finally:
        a.close(linger=0)
        b.close(linger=0)
    data = row["x"].data
    assert isinstance(data, zmq.Frame) and bytes(memoryview(data)) == big
    gc.collect()
    # the decode's view and its managed buffer are gone: they cost ≈250 bytes a tensor
    assert not [r for r in gc.get_referrers(data)
                if type(r).__name__ in ("memoryview", "managedbuffer")]


def test_restored_records_share_dtype_and_shape_objects():
    rows = [{"x": RawTensor("float32", [700], bytes(2800)), "y": RawTensor("float32", [700],
                                                                          bytes(2800))}] * 2
    got = []
    for i, row in enumerate(rows):
        bufs, _length, _crc = F.encode_record(i, row, gen=i, partition_id="p", key=f"k{i}")
        got.append(F.decode_record(b"".join(bytes(b) for b in bufs))[1])
    assert got[0]["x"].dtype is got[1]["y"].dtype == "float32"
    assert got[0]["x"].shape is got[1]["x"].shape is got[1]["y"].shape == (700,)
    assert got == rows


def test_a_unit_whose_last_row_is_dropped_forgets_the_shapes_its_rows_shared():
    """The shared shapes were made amid the rows' objects; kept after the last row went,
    they would hold the memory pages under them (docs/performance.md, *Unit memory*)."""
    from tqtx.storage.unit import StorageUnit
    from tqtx.wire import values

    u = StorageUnit(0, "tcp://127.0.0.1:9")  # never registers: only its row handlers run
    try:
        values.forget_shapes()
        rows = _put_rows(3)
        u.put_rows({"rows": [[i, r] for i, r in enumerate(rows)], "gens": [10, 11, 12]}, None)
        assert (300,) in values._SHAPES and (1000,) in values._SHAPES
        u.drop_rows({"indexes": [0, 1], "gens": [10, 11]}, None)
        assert (300,) in values._SHAPES and len(u.rows) == 1  # a row still shares them
        assert u.drop_rows({"indexes": [2, 7], "gens": [12, 17]}, None) == {"dropped": 1}
        assert values._SHAPES == {} and u.rows == {} and u.bytes_held == 0
        u.put_rows({"rows": [[5, _put_rows(1)[0]]], "gens": [15]}, None)  # and it goes on working
        assert u.rows[5]["a"].shape == (300,) and (300,) in values._SHAPES
    finally:
        u.server.socket.close(linger=0)
        u.server._wake.close(linger=0)
