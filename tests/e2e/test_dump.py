"""Selective dump by key with real processes (issue: dump_data_by_key / read_row_index)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

import tqtx as tq
from buffers import assert_same_rows, assert_same_value, rollout_batch
from tqtx import format as fmt
from tqtx.journal.dump import DumpJournal


def _siblings(dump_dir):
    parent, name = os.path.split(str(dump_dir))
    return sorted(x for x in os.listdir(parent) if x.startswith(name))


def test_dump_selected_keys_every_kind_of_field(tq_shared, pid, tmp_path):
    keys, td, tags = rollout_batch(30)
    tq.kv_batch_put(keys, pid, td, tags=tags)
    tq.kv_put("tag-only", pid, None, tag={"status": "running", "t": torch.arange(3)})
    selected = keys[1::3] + ["tag-only"]
    before = tq.kv_batch_get(keys, pid)
    rep = tq.dump_data_by_key(tmp_path / "d", selected, pid)
    assert rep["keys"] == len(selected) and rep["rows_with_data"] == len(selected) - 1
    assert rep["bytes"] == sum(os.path.getsize(os.path.join(r, f))
                               for r, _, fs in os.walk(tmp_path / "d") for f in fs)
    assert {"keys", "rows_with_data", "shards", "bytes", "dump_id", "seconds"} <= set(rep)
    idx = tq.read_row_index(tmp_path / "d")
    assert list(idx["rows"]) == selected  # only the selected keys, in order
    assert idx["partition_id"] == pid and idx["dump_id"] == rep["dump_id"]
    assert idx["rows"]["tag-only"]["fields"] == []
    assert_same_value(idx["rows"]["tag-only"]["tag"], {"status": "running", "t": torch.arange(3)})
    for i, k in enumerate(keys):
        if k in selected:
            assert_same_value(idx["rows"][k]["tag"], tags[i], k)
            assert idx["rows"][k]["fields"] == sorted(td.keys())
    sch = idx["field_schema"]
    assert sch["tokens"]["jagged"] and sch["tokens"]["dtype"] == "int64"
    assert sch["obs"]["shape"] == [4] and sch["reward"]["shape"] == []
    assert sch["text"]["kind"] == "object" and sch["half"]["dtype"] == "bfloat16"
    assert fmt.verify_dump(tmp_path / "d")["ok"]
    # live state unchanged: same indexes and values
    after = tq.kv_batch_get(keys, pid)
    assert_same_rows(before, after)
    # the dump's shards hold exactly the selected rows
    recs = {g for s in fmt.read_dump_index(tmp_path / "d").shards for g, *_ in s["records"]}
    assert recs == {idx["rows"][k]["global_index"] for k in selected if k != "tag-only"}
    assert set(_siblings(tmp_path / "d")) <= {"d", "d.journal.sqlite", "d.lock",
                                              "d.journal.sqlite-journal",
                                              "d.journal.sqlite.migrate.lock"}


def test_row_sliced_from_large_batch_costs_only_its_bytes(tq_shared, pid, tmp_path):
    big = torch.randn(64, 4096)  # 1 MiB batch, 16 KiB per row
    keys = [f"r{i}" for i in range(64)]
    tq.kv_batch_put(keys, pid, TensorDict({"x": big}, batch_size=[64]))
    rep = tq.dump_data_by_key(tmp_path / "one", ["r5"], pid)
    shard_bytes = sum(s["size"] for s in fmt.read_dump_index(tmp_path / "one").shards)
    assert 16384 <= shard_bytes < 16384 + 512
    assert rep["rows_with_data"] == 1
    got = tq.kv_batch_get(["r5"], pid)["x"]
    assert torch.equal(got[0], big[5])


def test_heterogeneous_fields_duplicates_and_replace(tq_shared, pid, tmp_path):
    tq.kv_put("a", pid, {"x": torch.ones(2)})
    tq.kv_put("b", pid, {"y": torch.zeros(3, dtype=torch.int32)}, tag={"k": 1})
    tq.kv_put("c", pid, {"x": torch.full((2,), 5.0), "y": torch.ones(3, dtype=torch.int32)})
    rep = tq.dump_data_by_key(tmp_path / "d", ["b", "a", "b", "c", "a"], pid)
    assert rep["keys"] == 3
    idx = tq.read_row_index(tmp_path / "d")
    assert list(idx["rows"]) == ["b", "a", "c"]
    assert idx["rows"]["a"]["fields"] == ["x"] and idx["rows"]["b"]["fields"] == ["y"]
    assert idx["rows"]["c"]["fields"] == ["x", "y"]
    first_id = rep["dump_id"]
    # replacing an existing dump: the new one in place, no leftovers
    rep2 = tq.dump_data_by_key(tmp_path / "d", ["c"], pid)
    idx2 = tq.read_row_index(tmp_path / "d")
    assert idx2["dump_id"] == rep2["dump_id"] != first_id and list(idx2["rows"]) == ["c"]
    assert not [s for s in _siblings(tmp_path / "d") if ".tmp-" in s or s.endswith(".old")]
    with DumpJournal(tmp_path / "d") as dj:
        phases = [p["phase"] for p in dj.publications()]
    assert phases == ["cleaned", "cleaned"]


def test_empty_key_list_is_a_valid_loadable_dump(tq_shared, pid, tmp_path):
    rep = tq.dump_data_by_key(tmp_path / "empty", [], pid)
    assert rep["keys"] == 0 and rep["rows_with_data"] == 0 and rep["shards"] == 0
    assert tq.read_row_index(tmp_path / "empty")["rows"] == {}
    assert fmt.verify_dump(tmp_path / "empty")["ok"]
    res = tq.load_data_by_key(tmp_path / "empty", partition_id=pid + "-x")
    assert res["keys"] == 0


def test_unknown_key_or_partition_leaves_nothing(tq_shared, pid, tmp_path):
    tq.kv_put("a", pid, {"x": torch.ones(1)})
    with pytest.raises(KeyError) as ei:
        tq.dump_data_by_key(tmp_path / "d", ["a", "nope1", "nope2"], pid)
    assert "nope1" in str(ei.value) and "nope2" in str(ei.value)
    with pytest.raises(KeyError) as ei:
        tq.dump_data_by_key(tmp_path / "d", ["a"], "no-such-partition")
    assert "no-such-partition" in str(ei.value)
    assert os.listdir(tmp_path) == []


def test_failing_unit_leaves_previous_dump_intact(tq_start, tmp_path):
    tq_start(2, unit_env={1: {"TQTX_FAULTS": "unit.dump.before_write@2:raise"}})
    keys, td, tags = rollout_batch(10)
    tq.kv_batch_put(keys, "p", td, tags=tags)
    first = tq.dump_data_by_key(tmp_path / "d", keys, "p")  # unit 1's first dump works
    with pytest.raises(RuntimeError, match="fault injected"):
        tq.dump_data_by_key(tmp_path / "d", keys[:4], "p")
    assert tq.read_row_index(tmp_path / "d")["dump_id"] == first["dump_id"]
    assert fmt.verify_dump(tmp_path / "d")["ok"]
    assert not [s for s in _siblings(tmp_path / "d") if ".tmp-" in s or s.endswith(".old")]
    with DumpJournal(tmp_path / "d") as dj:
        assert [p["phase"] for p in dj.publications()] == ["cleaned", "failed"] or \
            sorted(p["phase"] for p in dj.publications()) == ["cleaned", "failed"]


CRASH_SCRIPT = r"""
import os, sys, tqtx as tq
tq.init(address=os.environ["ADDR"])
tq.dump_data_by_key(sys.argv[1], sys.argv[2].split(","), "p")
print("DONE")
"""


@pytest.mark.parametrize("phase,expect", [
    ("after_staging", "old"), ("after_written", "old"), ("after_synced", "old"),
    ("after_old_moved", "either"), ("after_published", "new"), ("after_cleaned", "new")])
def test_crash_between_publication_phases_recovers_old_or_new(tq_start, tmp_path, phase, expect):
    cfg = tq_start(2)
    keys, td, tags = rollout_batch(12)
    tq.kv_batch_put(keys, "p", td, tags=tags)
    old = tq.dump_data_by_key(tmp_path / "d", keys[:5], "p")
    env = {**os.environ, "ADDR": cfg["address"], "TQTX_FAULTS": f"publish.{phase}:kill"}
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path / "d"),
                           ",".join(keys[5:])], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    # next access recovers (read_row_index takes the lock and replays the dump journal)
    idx = tq.read_row_index(tmp_path / "d")
    which = "old" if idx["dump_id"] == old["dump_id"] else "new"
    if expect != "either":
        assert which == expect
    assert list(idx["rows"]) == (keys[:5] if which == "old" else keys[5:])
    assert fmt.verify_dump(tmp_path / "d")["ok"]
    assert not [s for s in _siblings(tmp_path / "d") if ".tmp-" in s or s.endswith(".old")]
    with DumpJournal(tmp_path / "d") as dj:
        assert not dj.unfinished_publications()


def test_two_processes_dumping_one_path_are_serialized(tq_start, tmp_path):
    cfg = tq_start(2)
    keys, td, tags = rollout_batch(40)
    tq.kv_batch_put(keys, "p", td, tags=tags)
    env = {**os.environ, "ADDR": cfg["address"]}
    procs = [subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path / "d"),
                               ",".join(ks)], env=env, stdout=subprocess.PIPE, text=True)
             for ks in (keys[:20], keys[20:])]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and "DONE" in out
    idx = tq.read_row_index(tmp_path / "d")
    assert list(idx["rows"]) in (keys[:20], keys[20:])
    assert fmt.verify_dump(tmp_path / "d")["ok"]
    with DumpJournal(tmp_path / "d") as dj:
        pubs = sorted(dj.publications(), key=lambda p: p["created_at"])
    assert [p["phase"] for p in pubs] == ["cleaned", "cleaned"]
    assert pubs[0]["updated_at"] <= pubs[1]["created_at"]  # no overlap: the lock serialized them


@pytest.mark.strict
def test_no_payload_byte_passes_through_the_client(tq_shared, pid, tmp_path):
    n = 64
    td = TensorDict({"x": torch.randn(n, 16384)}, batch_size=[n])  # 4 MiB
    keys = [f"k{i}" for i in range(n)]
    tq.kv_batch_put(keys, pid, td)
    client = tq.get_client()
    before = client.received_from_units()
    rep = tq.dump_data_by_key(tmp_path / "d", keys, pid)
    after = client.received_from_units()
    assert rep["bytes"] > n * 16384 * 4
    assert after["payload_frames"] == before["payload_frames"]
    assert after["payload_bytes"] == before["payload_bytes"]
    # replies carry offsets/lengths/checksums only: a few dozen bytes per row
    assert after["header_bytes"] - before["header_bytes"] < 100 * n
    # and so does the restore
    tq.kv_clear(keys, pid)
    before = client.received_from_units()
    tq.load_data_by_key(tmp_path / "d")
    after = client.received_from_units()
    assert after["payload_bytes"] == before["payload_bytes"]
    assert after["header_bytes"] - before["header_bytes"] < 2000
    assert torch.equal(tq.kv_batch_get(keys, pid)["x"], td["x"])


def test_via_client_writes_the_same_format(tq_shared, pid, tmp_path):
    keys, td, tags = rollout_batch(9)
    tq.kv_batch_put(keys, pid, td, tags=tags)
    rep = tq.dump_data_by_key(tmp_path / "c", keys, pid, via="client")
    assert rep["rows_with_data"] == 9 and rep["shards"] == 1
    assert fmt.verify_dump(tmp_path / "c")["ok"]
    info = json.loads((tmp_path / "c" / "dump_info.json").read_text())
    assert info["writer"] == "client"
    before = tq.kv_batch_get(keys, pid)
    tq.kv_clear(keys, pid)
    tq.load_data_by_key(tmp_path / "c")
    assert_same_rows(before, tq.kv_batch_get(keys, pid), keys)


def test_cli_inspect_and_verify(tq_shared, pid, tmp_path):
    keys, td, tags = rollout_batch(6)
    tq.kv_batch_put(keys, pid, td, tags=tags)
    tq.dump_data_by_key(tmp_path / "d", keys, pid)
    out = subprocess.run(["tqtx", "inspect", str(tmp_path / "d"), "--json"], capture_output=True,
                         text=True, check=True).stdout
    info = json.loads(out)
    assert info["keys"] == 6 and info["partition_id"] == pid
    assert subprocess.run(["tqtx", "verify", str(tmp_path / "d")]).returncode == 0
    shard = next((tmp_path / "d" / "shards").glob("*.bin"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = subprocess.run(["tqtx", "verify", str(tmp_path / "d")], capture_output=True, text=True)
    assert res.returncode == 1 and shard.name in res.stdout
