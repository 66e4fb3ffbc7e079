"""The row fence: no read, put, clear, dump or checkpoint ever touches another key's row.

Each test makes the race deterministic: at a fault point between a request's controller
step and its unit step (``client.get.after_lookup``, ``client.put.after_alloc``, ...), the
key is cleared and its index given to another key (the controller reuses the lowest freed
index first), then the request goes on. Without the fence each of these read, dumped,
overwrote or dropped the other key's row.
"""
from __future__ import annotations

import os

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from tqtx import faults
from tqtx import format as fmt

# These tests compare dense columns and expect KeysNotFoundError for missing keys:
# tqtx's strict mode (docs/compatibility.md); the fence is the same in both modes.
pytestmark = pytest.mark.strict

P = "fence"


def _td(*values):
    return TensorDict({"x": torch.tensor([[v] * 3 for v in values], dtype=torch.int64)},
                      batch_size=[len(values)])


def _put(keys, *values, pid=P):
    tq.kv_batch_put(list(keys), pid, _td(*values), tags=[{"v": v} for v in values])


def _index(key, pid=P) -> int:
    return tq.get_client().controller.call(
        "LOOKUP", {"partition_id": pid, "keys": [key], "select_fields": None})["indexes"][0]


@pytest.fixture
def race(monkeypatch):
    """``race(point, fn)``: run ``fn()`` the first time fault point ``point`` is hit in this
    process (its own fault points are not raced); returns a list that counts the hits."""
    def arm(point, fn):
        hits = []
        real = faults.hit

        def spy(name):
            if name == point:
                hits.append(name)
                if len(hits) == 1:
                    monkeypatch.setattr(faults, "hit", real)
                    try:
                        fn()
                    finally:
                        monkeypatch.setattr(faults, "hit", spy)
            real(name)

        monkeypatch.setattr(faults, "hit", spy)
        return hits
    return arm


@pytest.fixture
def dep(no_lease, tq_start):
    return tq_start(num_units=2)


def _clear_and_reuse(old="a", new="b", value=2):
    """Clear ``old`` and put ``new`` at the index it freed."""
    idx = _index(old)
    tq.kv_clear([old], P)
    _put([new], value)
    assert _index(new) == idx  # the race is real: the other key sits at that index now


def test_get_that_raced_a_clear_and_reuse_is_keys_not_found(dep, race):
    _put(["a"], 1)
    hits = race("client.get.after_lookup", _clear_and_reuse)
    with pytest.raises(tq.KeysNotFoundError, match="'a'"):
        tq.kv_batch_get(["a"], P)
    assert hits  # the first LOOKUP found it; the unit refused; LOOKUP again: gone
    assert tq.kv_batch_get(["b"], P)["x"].tolist() == [[2, 2, 2]]


def test_get_of_a_key_put_again_at_its_index_reads_the_new_value(dep, race):
    _put(["a", "c"], 1, 3)

    def clear_and_put_again():
        tq.kv_clear(["a"], P)
        _put(["a"], 9)
    hits = race("client.get.after_lookup", clear_and_put_again)
    assert tq.kv_batch_get(["a", "c"], P)["x"].tolist() == [[9, 9, 9], [3, 3, 3]]
    assert len(hits) == 2


def test_put_that_raced_a_clear_and_reuse_leaves_the_other_key_alone(dep, race):
    _put(["a", "c"], 1, 3)
    hits = race("client.put.after_alloc", _clear_and_reuse)
    _put(["a", "c"], 5, 6)  # ALLOC gave a's old index; b holds it when the rows arrive
    # a existed when the put began and was cleared while it ran: the put came first (it
    # is not written again, which could undo a later put of a); c is stored
    assert len(hits) == 1
    assert tq.kv_batch_get(["b", "c"], P)["x"].tolist() == [[2, 2, 2], [6, 6, 6]]
    assert tq.kv_list(P)[P] == {"b": {"v": 2}, "c": {"v": 6}}


def test_put_of_a_new_key_abandoned_meanwhile_is_redone(dep, race):
    client = tq.get_client()._client  # the internal client (get_client is the data plane)

    def abandon_and_reuse():
        # a second put of the same new key fails: its ALLOC saw the key pending, its
        # abort releases it, and the index goes to another key
        alloc = client.controller.call("ALLOC", {"partition_id": P, "keys": ["n"],
                                                 "schemas": {}})
        client.controller.call("ABORT_PUT", {"partition_id": P, "keys": ["n"],
                                             "gens": alloc["gens"]})
        _put(["m"], 2)
        assert _index("m") == alloc["indexes"][0]
    hits = race("client.put.after_alloc", abandon_and_reuse)
    _put(["n"], 7)
    assert len(hits) == 2  # n's rows were never visible: it was put again, elsewhere
    assert tq.kv_batch_get(["m", "n"], P)["x"].tolist() == [[2, 2, 2], [7, 7, 7]]
    assert _index("n") != _index("m")


def test_clear_whose_drop_comes_after_the_index_was_reused_drops_nothing_else(dep, race):
    _put(["a"], 1)
    race("client.clear.before_drop", lambda: _put(["b"], 2))
    tq.kv_clear(["a"], P)
    assert tq.kv_batch_get(["b"], P)["x"].tolist() == [[2, 2, 2]]


def test_failed_put_leaves_no_row_of_its_new_keys(dep, monkeypatch):
    client = tq.get_client()._client  # the internal client (get_client is the data plane)
    real = client.fan_out

    def put_fails_on_one_unit(op, per_unit, *args, **kwargs):
        if op == "PUT_ROWS":
            real(op, {u: b for u, b in per_unit.items() if u == 0}, *args, **kwargs)
            raise tq.PeerTimeoutError("unit 1 did not reply (injected)")
        return real(op, per_unit, *args, **kwargs)
    monkeypatch.setattr(client, "fan_out", put_fails_on_one_unit)
    with pytest.raises(tq.PeerTimeoutError):
        _put(["n0", "n1", "n2", "n3"], 1, 2, 3, 4)
    monkeypatch.setattr(client, "fan_out", real)
    assert tq.kv_list(P) == {}
    assert [u["rows"] for u in client.stats()["units"]] == [0, 0]
    _put(["n0"], 7)  # the abandoned index is given out again and works
    assert tq.kv_batch_get(["n0"], P)["x"].tolist() == [[7, 7, 7]]


def _dumped_values(dump_dir) -> dict:
    """{key: x values} of a dump, read offline, each record checked against its key."""
    idx = fmt.read_dump_index(dump_dir)
    idents = idx.record_idents()
    key_of = {g: k for k, g, _f, _t in idx.rows}
    out = {}
    for shard in idx.shards:
        for batch in fmt.read_records(shard["path"], shard["records"], expect=idents):
            for gidx, row in batch:
                out[key_of[gidx]] = list(memoryview(row["x"].data).cast("q"))
    return out


@pytest.mark.parametrize("block", [True, False])
def test_dump_that_raced_a_clear_and_reuse_fails_without_a_foreign_row(dep, race, tmp_path,
                                                                       block):
    _put(["a", "c"], 1, 3)
    hits = race("client.dump.after_describe", _clear_and_reuse)
    with pytest.raises(tq.KeysNotFoundError, match="'a'"):
        handle = tq.dump_data_by_key(tmp_path / "d", ["a", "c"], P, block=block)
        if not block:
            handle.result()
    assert hits and not (tmp_path / "d").exists()


@pytest.mark.parametrize("block", [True, False])
def test_dump_of_a_key_put_again_holds_its_new_value(dep, race, tmp_path, block):
    _put(["a", "c"], 1, 3)

    def clear_and_put_again():
        tq.kv_clear(["a"], P)
        _put(["a"], 9)
    race("client.dump.after_describe", clear_and_put_again)
    handle = tq.dump_data_by_key(tmp_path / "d", ["a", "c"], P, block=block)
    if not block:
        handle.result()
    assert _dumped_values(tmp_path / "d") == {"a": [9, 9, 9], "c": [3, 3, 3]}
    assert fmt.verify_dump(tmp_path / "d")["ok"]
    assert tq.read_row_index(tmp_path / "d")["rows"]["a"]["tag"] == {"v": 9}


def test_checkpoint_leaves_out_a_key_cleared_while_it_ran(dep, race, tmp_path):
    _put(["a", "c"], 1, 3)
    race("client.checkpoint.after_snapshot", _clear_and_reuse)
    saved = tq.save_checkpoint(tmp_path / "ck")
    assert saved["keys"] == 1  # a: cleared after the snapshot; b: put after it
    tq.kv_clear(["b", "c"], P)
    tq.load_checkpoint(tmp_path / "ck")
    assert tq.kv_list(P) == {P: {"c": {"v": 3}}}
    assert tq.kv_batch_get(["c"], P)["x"].tolist() == [[3, 3, 3]]
    # the checkpoint's rows took generations of this controller: they are served, and a
    # put over them (same key) and of a new key (new index) both work
    _put(["c", "d"], 4, 5)
    assert tq.kv_batch_get(["c", "d"], P)["x"].tolist() == [[4, 4, 4], [5, 5, 5]]


def test_every_request_names_generations_and_units_refuse_other_ones(dep):
    client = tq.get_client()._client  # the internal client (get_client is the data plane)
    _put(["a"], 1)
    meta = client.controller.call("LOOKUP", {"partition_id": P, "keys": ["a"],
                                             "select_fields": None})
    idx, gen = meta["indexes"][0], meta["gens"][0]
    unit = client.unit(client.owner(idx))
    assert unit.call("GET_ROWS", {"indexes": [idx], "gens": [gen], "fields": ["x"]})
    with pytest.raises(tq.StaleRowsError) as ei:
        unit.call("GET_ROWS", {"indexes": [idx], "gens": [gen + 1], "fields": ["x"]})
    assert ei.value.indexes == [idx]
    # a write of an older generation is refused, a drop of another one does nothing
    reply = unit.call("PUT_ROWS", {"rows": [[idx, {}]], "gens": [gen - 1]})
    assert reply["stale"] == [idx] and reply["rows"] == 0
    assert unit.call("DROP_ROWS", {"indexes": [idx], "gens": [gen - 1]}) == {"dropped": 0}
    assert tq.kv_batch_get(["a"], P)["x"].tolist() == [[1, 1, 1]]


def test_generations_are_never_given_twice_across_controller_restarts(tq_start, tmp_path):
    state = str(tmp_path / "state")
    seen = set()
    for _ in range(2):
        tq_start(num_units=1, state_dir=state, durability="controller")
        client = tq.get_client()._client  # the internal client (get_client is the data plane)
        for i in range(3):
            alloc = client.controller.call("ALLOC", {"partition_id": P, "keys": [f"k{i}"],
                                                     "schemas": {}})
            seen.update(alloc["gens"])
            tq.kv_clear([f"k{i}"], P)
        tq.close()
    assert len(seen) == 6


def test_a_dump_whose_records_name_other_keys_is_refused_naming_them(dep, tmp_path):
    """Swap the two rows of the row index: each record now lies about its key."""
    from tqtx.layout import fsutil
    from tqtx.wire import codec
    _put(["a", "c"], 1, 3)
    d = tmp_path / "d"
    tq.dump_data_by_key(d, ["a", "c"], P)
    ri = codec.unpackb((d / fmt.ROW_INDEX).read_bytes())
    (ka, *ra), (kc, *rc) = ri["rows"]
    ri["rows"] = [[kc, *ra], [ka, *rc]]
    data = codec.packb(ri)
    fsutil.write_file_synced(d / fmt.ROW_INDEX, data)
    manifest = (d / fmt.MANIFEST).read_text()
    import json
    m = json.loads(manifest)
    m["row_index"].update(size=len(data), crc32=fmt.checksum(data))
    (d / fmt.MANIFEST).write_text(json.dumps(m))
    report = fmt.verify_dump(d)
    assert not report["ok"] and {e["key"] for e in report["errors"]} == {"a", "c"}
    assert all("another key's row" in e["error"] for e in report["errors"])
    tq.kv_clear(["a", "c"], P)
    with pytest.raises(tq.DumpFormatError, match="another key's row"):
        tq.load_data_by_key(d)
    assert tq.kv_list(P) == {}  # nothing of it is visible


def _as_version_1(d):
    """Rewrite dump ``d`` as tqtx wrote dumps before records named their row: version 1
    records (no partition, key or generation), row index rows of 4, format_version 1."""
    import json
    import struct
    from tqtx.layout import fsutil
    from tqtx.wire import codec
    m = json.loads((d / fmt.MANIFEST).read_text())
    for s in m["shards"]:
        idx = codec.unpackb((d / s["index"]["file"]).read_bytes())
        data = (d / s["file"]).read_bytes()
        out, records = b"", []
        for gidx, off, length, _crc in idx["records"]:
            rec = data[off:off + length]
            hlen = struct.unpack_from("<I", rec, 4)[0]
            header = codec.unpackb(rec[8:8 + hlen])
            new_header = codec.packb({"i": header["i"], "f": header["f"]})
            new = b"TQR1" + struct.pack("<I", len(new_header)) + new_header + rec[8 + hlen:]
            records.append([gidx, len(out), len(new), fmt.checksum(new)])
            out += new
        (d / s["file"]).write_bytes(out)
        idx.update(format_version=1, records=records)
        packed = codec.packb(idx)
        fsutil.write_file_synced(d / s["index"]["file"], packed)
        s.update(size=len(out), index={**s["index"], "size": len(packed),
                                       "crc32": fmt.checksum(packed)})
    ri = codec.unpackb((d / fmt.ROW_INDEX).read_bytes())
    ri.update(format_version=1, rows=[r[:4] for r in ri["rows"]])
    packed = codec.packb(ri)
    fsutil.write_file_synced(d / fmt.ROW_INDEX, packed)
    m.update(format_version=1, bytes=sum(s["size"] for s in m["shards"]))
    m["row_index"].update(size=len(packed), crc32=fmt.checksum(packed))
    (d / fmt.MANIFEST).write_text(json.dumps(m))


def test_version_1_dumps_still_load(dep, tmp_path):
    _put(["a", "c"], 1, 3)
    d = tmp_path / "d"
    tq.dump_data_by_key(d, ["a", "c"], P)
    _as_version_1(d)
    assert fmt.read_dump_index(d).version == 1
    assert fmt.verify_dump(d)["ok"]
    tq.kv_clear(["a", "c"], P)
    assert tq.load_data_by_key(d, partition_id="old")["keys"] == 2
    assert tq.kv_batch_get(["a", "c"], "old")["x"].tolist() == [[1, 1, 1], [3, 3, 3]]
    assert tq.load_data_by_key(d, via="client", partition_id="old2")["keys"] == 2
    assert tq.kv_batch_get(["c"], "old2")["x"].tolist() == [[3, 3, 3]]
    assert os.path.isdir(d)
