"""Malformed, truncated and oversized frames sent straight to controller and unit sockets.

Every one gets an error reply and the process keeps serving (a normal put/get works after).
"""
from __future__ import annotations

import pickle
import uuid

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tqtx as tq
from tqtx.wire import codec

pytestmark = pytest.mark.strict  # the tests compare dense columns

EXT_FRAME, EXT_INLINE = codec.EXT_TENSOR_FRAME, codec.EXT_TENSOR_INLINE
GEN = 1 << 62  # the generation of the hostile puts' rows: above any the controller gives


def _req(op, body, rid=None):
    return msgpack.packb({"op": op, "rid": rid or uuid.uuid4().hex, "body": body},
                         use_bin_type=True)


def _tensor_req(ext, index=10 ** 9):
    return msgpack.packb({"op": "PUT_ROWS", "rid": uuid.uuid4().hex,
                          "body": {"rows": [[index, {"x": ext}]], "gens": [GEN]}},
                         use_bin_type=True)


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _cases(marker: str) -> dict:
    """name -> list of frames."""
    ext = msgpack.ExtType
    pk = msgpack.packb
    evil = pickle.dumps(_Marker(marker))
    deep = b"\x91" * 100_000 + b"\xc0"   # 100k nested one-element arrays
    return {
        "garbage": [b"\x00\xff\xfe garbage \xc1\xc1"],
        "empty_frame": [b""],
        "reserved_byte": [b"\xc1"],
        "truncated_msgpack": [_req("PING", {})[:-3]],
        "not_a_map": [pk([1, 2, 3])],
        "op_not_str": [pk({"op": 5, "rid": "x"})],
        "unknown_op": [_req("NO_SUCH_OP", {})],
        "body_wrong_type": [_req("PUT_ROWS", [1, 2])],
        "body_is_tensor": [pk({"op": "GET_ROWS", "rid": "x",
                               "body": ext(EXT_INLINE, pk(["uint8", [1], b"\x00"]))})],
        "rows_wrong_shape": [_req("PUT_ROWS", {"rows": [[1, "not a dict"]], "gens": [GEN]})],
        "gens_missing": [_req("PUT_ROWS", {"rows": [[1, {}]]})],
        "gens_torn": [_req("PUT_ROWS", {"rows": [[1, {}]], "gens": [GEN, GEN]})],
        "gens_not_ints": [_req("GET_ROWS", {"indexes": [1], "gens": ["a"], "fields": []})],
        "rows_not_pairs": [_req("PUT_ROWS", {"rows": [1, 2, 3]})],
        "indexes_wrong": [_req("GET_ROWS", {"indexes": "abc", "fields": 7})],
        "alloc_unhashable": [_req("LOOKUP", {"partition_id": ["x"], "keys": [[1]]})],
        "map_nonstr_keys": [pk({1: 2, 3: 4})],
        "ext_99": [pk({"op": "PING", "rid": "x", "body": ext(99, b"\x00" * 16)})],
        "ext_99_pickle": [pk({"op": "PING", "rid": "x", "body": {"v": ext(99, evil)}})],
        "pickle_header": [evil],
        "pickle_as_frame": [_tensor_req(ext(EXT_FRAME, pk(["uint8", [len(evil)], 1])),
                                       index=10 ** 9 + 1), evil],
        "frame_missing": [_tensor_req(ext(EXT_FRAME, pk(["float32", [4], 1])))],
        "frame_ref_zero": [_tensor_req(ext(EXT_FRAME, pk(["float32", [0], 0]))), b""],
        "frame_ref_str": [_tensor_req(ext(EXT_FRAME, pk(["float32", [1], "1"]))), b"\0" * 4],
        "frame_size_mismatch": [_tensor_req(ext(EXT_FRAME, pk(["float32", [4], 1]))), b"\0" * 15],
        "inline_size_mismatch": [_tensor_req(ext(EXT_INLINE, pk(["float32", [4], b"abc"])))],
        "unknown_dtype": [_tensor_req(ext(EXT_INLINE, pk(["float128", [1], b"\0" * 16])))],
        "dtype_not_str": [_tensor_req(ext(EXT_INLINE, pk([7, [1], b"\0"])))],
        "negative_shape": [_tensor_req(ext(EXT_INLINE, pk(["uint8", [-1], b""])))],
        "shape_strings": [_tensor_req(ext(EXT_INLINE, pk(["uint8", ["a"], b"\0"])))],
        "shape_nested": [_tensor_req(ext(EXT_INLINE, pk(["uint8", [[1]], b"\0"])))],
        "huge_shape_inline": [_tensor_req(ext(EXT_INLINE, pk(["float64", [2 ** 32, 2 ** 32],
                                                                b"\0" * 8])))],
        "huge_shape_frame": [_tensor_req(ext(EXT_FRAME, pk(["float64", [2 ** 63], 1]))),
                             b"\0" * 8],
        "huge_shape_uint64": [_tensor_req(ext(EXT_INLINE, pk(["uint8", [2 ** 64 - 1], b""])))],
        "tensor_header_garbage": [_tensor_req(ext(EXT_INLINE, b"\xc1\xc1"))],
        "tensor_header_short": [_tensor_req(ext(EXT_INLINE, pk(["uint8", [1]])))],
        "huge_array_decl": [b"\xdd\xff\xff\xff\xff"],
        "huge_map_decl": [b"\xdf\xff\xff\xff\xff"],
        "huge_bin_decl": [b"\xc6\xff\xff\xff\xff" + b"\0" * 10],
        "deep_nesting": [deep],
        "garbage_64MiB": [b"\xc1" + b"\xab" * (64 << 20)],
        "valid_plus_64MiB_frame": [_req("PING", {}), b"\xab" * (64 << 20)],
    }


def _send_all(address: str, cases: dict, timeout: float = 30.0) -> dict:
    """Send every case on its own DEALER socket; name -> decoded reply (or None)."""
    ctx = zmq.Context.instance()
    socks = {}
    try:
        for name, frames in cases.items():
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            s.send_multipart(frames)
            socks[name] = s
        replies = {}
        poller = zmq.Poller()
        for s in socks.values():
            poller.register(s, zmq.POLLIN)
        import time
        deadline = time.monotonic() + timeout
        while len(replies) < len(socks) and time.monotonic() < deadline:
            for s, _ in poller.poll(500):
                name = next(n for n, x in socks.items() if x is s)
                replies[name] = codec.decode(s.recv_multipart())
                poller.unregister(s)
        return {n: replies.get(n) for n in cases}
    finally:
        for s in socks.values():
            s.close(0)


def _still_serving(pid: str) -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    from tensordict import TensorDict
    keys = [f"ok{i}" for i in range(3)]
    tq.kv_batch_put(keys, pid, TensorDict({"x": x}, batch_size=[3]))
    assert torch.equal(tq.kv_batch_get(keys, pid)["x"], x)
    client = tq.get_client()
    for u in range(client.num_units):
        assert client.unit(u).call("PING", timeout=10)["unit_id"] == u
    tq.kv_clear(keys, pid)


@pytest.mark.parametrize("target", ["controller", "unit"])
def test_malformed_frames_get_error_replies(tq_shared, pid, target, tmp_path):
    marker = tmp_path / "PWNED"
    address = tq_shared["address"] if target == "controller" else tq_shared["units"][0]
    cases = _cases(str(marker))
    replies = _send_all(address, cases)
    silent = [n for n, r in replies.items() if r is None]
    assert not silent, f"{target}: no reply to {silent}"
    accepted = [n for n, r in replies.items() if r.get("ok")]
    # a valid PING with an extra unreferenced frame is simply answered; a unit stores a
    # uint8 tensor whose bytes happen to be a pickle as the opaque bytes they are
    allowed = {"valid_plus_64MiB_frame"} | ({"pickle_as_frame"} if target == "unit" else set())
    assert set(accepted) <= allowed, f"{target}: accepted {accepted}"
    for name, r in replies.items():
        if not r.get("ok"):
            assert r["error"]["type"] and r["error"]["message"], (name, r)
    assert not marker.exists()
    _still_serving(pid)
    if target == "unit":
        # no hostile put left a row behind at the (absurd) index it named
        client = tq.get_client()
        with pytest.raises(tq.StaleRowsError):
            client.unit(0).call("GET_ROWS", {"indexes": [10 ** 9], "gens": [GEN],
                                             "fields": ["x"]})
        stored = client.unit(0).call("GET_ROWS", {"indexes": [10 ** 9 + 1], "gens": [GEN],
                                                  "fields": ["x"]})
        from tqtx.client import unpack_column
        value = unpack_column(stored["columns"][0])[0]
        assert bytes(value.data) == pickle.dumps(_Marker(str(marker)))
        client.unit(0).call("DROP_ROWS", {"indexes": [10 ** 9 + 1], "gens": [GEN]})
        assert not marker.exists()


@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=256), min_size=1, max_size=3))
def test_fuzz_random_frames(tq_shared, frames):
    """Random bytes: an error reply (or, rarely, a valid request's reply), never silence."""
    replies = _send_all(tq_shared["units"][1], {"c": frames}, timeout=10)
    replies.update({"ctl": _send_all(tq_shared["address"], {"c": frames}, timeout=10)["c"]})
    assert all(r is not None for r in replies.values()), replies
    client = tq.get_client()
    assert client.unit(1).call("PING", timeout=10)["unit_id"] == 1
    client.controller.call("PING", timeout=10)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.sampled_from(["PUT_ROWS", "GET_ROWS", "DROP_ROWS", "APPLY_STAGED", "DROP_STAGED",
                           "DUMP_SNAPSHOT", "DUMP_WAIT", "DUMP_CANCEL", "STATS", "ALLOC",
                           "COMMIT_PUT", "LOOKUP", "LIST", "CLEAR", "GET_RESTORE",
                           "DESCRIBE_ROWS_BY_KEY", "TAKE_DUMP_TAGS",
                           "VALIDATE_DUMP_SCHEMA", "RESTORE_UNIT", "FINISH_RESTORE"]),
       body=st.recursive(st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1)
                         | st.text(max_size=8) | st.binary(max_size=8),
                         lambda kids: st.lists(kids, max_size=4)
                         | st.dictionaries(st.sampled_from(
                             ["partition_id", "keys", "rows", "indexes", "fields", "fresh",
                              "restore_id", "unit_id", "action", "schemas", "field_schema",
                              "dump_id", "commit", "select_fields", "tags", "fields_of",
                              "field_sets", "hold_tags", "packed"]), kids, max_size=5),
                         max_leaves=12))
def test_fuzz_wrong_shaped_bodies(tq_shared, op, body):
    """Valid msgpack of the wrong shape for every handler: an error reply, still serving."""
    pid = f"fz-{uuid.uuid4().hex[:6]}"
    if isinstance(body, dict) and "partition_id" in body:
        body["partition_id"] = pid  # never touch other tests' partitions
    target = tq_shared["units"][2] if op in ("PUT_ROWS", "GET_ROWS", "DROP_ROWS", "APPLY_STAGED",
                                              "DROP_STAGED", "DUMP_SNAPSHOT", "DUMP_WAIT",
                                              "DUMP_CANCEL", "STATS") else tq_shared["address"]
    r = _send_all(target, {"c": [_req(op, body)]}, timeout=10)["c"]
    assert r is not None, f"{op} {body!r}: no reply"
    client = tq.get_client()
    assert client.unit(2).call("PING", timeout=10)["unit_id"] == 2
    client.controller.call("PING", timeout=10)


def test_torn_dump_snapshot_columns_are_refused(tq_shared):
    """Index and field-set columns that do not line up: refused, nothing held."""
    from tqtx.wire.columns import pack_int64
    unit = tq.get_client().unit(2)
    dump_id = f"torn-{uuid.uuid4().hex[:6]}"
    g = pack_int64([GEN])
    bad = [
        ({"indexes": pack_int64([2, 6]), "fields_of": pack_int64([0]), "field_sets": [["x"]],
          "gens": pack_int64([GEN, GEN]), "keys": ["a", "b"]},
         "2 indexes but 1 field-set numbers"),
        ({"indexes": pack_int64([2, 6]), "fields_of": pack_int64([0, 0]),
          "field_sets": [["x"]], "gens": g, "keys": ["a", "b"]},
         "2 indexes but 2 field-set numbers, 1 generations"),
        ({"indexes": pack_int64([2]), "fields_of": pack_int64([3]), "field_sets": [["x"]],
          "gens": g, "keys": ["a"]},
         "field-set number outside the 1 field sets"),
        ({"indexes": b"\x00" * 12, "fields_of": [], "field_sets": [], "gens": [], "keys": []},
         "int64 column of 12"),
    ]
    for body, message in bad:
        with pytest.raises(ValueError, match=message):
            unit.call("DUMP_SNAPSHOT", {"dump_id": dump_id, "partition_id": "p", **body},
                      timeout=10)
    assert dump_id not in unit.call("STATS", timeout=10)["open_dumps"]


def test_dump_that_asks_for_an_index_beside_a_misnamed_shard_is_refused(tq_shared, tmp_path):
    """A unit writes a shard's index only beside a shard named as the format says
    (``<dir>/shards/unit-<k>.bin``): elsewhere it could truncate a file that is not tqtx's.
    Refused before anything is written or held."""
    from tqtx.wire.columns import pack_int64
    unit = tq.get_client().unit(2)
    dump_id = f"misnamed-{uuid.uuid4().hex[:6]}"
    path = tmp_path / "shards" / "unit-1.bin"  # unit 1's name, sent to unit 2
    path.parent.mkdir()
    body = {"dump_id": dump_id, "indexes": pack_int64([]), "fields_of": pack_int64([]),
            "gens": pack_int64([]), "keys": [], "partition_id": "p",
            "field_sets": [], "path": str(path), "index": True}
    with pytest.raises(ValueError, match="not the shard of unit 2"):
        unit.call("DUMP_ROWS", body, timeout=10)
    assert list(tmp_path.rglob("*")) == [path.parent]
    assert dump_id not in unit.call("STATS", timeout=10)["open_dumps"]
