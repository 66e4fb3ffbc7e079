"""Transactional restore by key with real processes (issue: load_data_by_key & co)."""
from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

import tqtx as tq
from buffers import assert_same_rows, assert_same_value, rollout_batch
from whole_job import kill_whole_job
from tqtx import RestorePendingError
from tqtx.errors import PeerDiedError
from tqtx import format as fmt

# These tests compare dense columns and expect KeysNotFoundError for missing keys:
# tqtx's strict mode (docs/compatibility.md); the fence is the same in both modes.
pytestmark = pytest.mark.strict


def journal_json(state_dir=None, dump_dir=None) -> dict:
    args = ["tqtx", "journal", "show", "--json"]
    args += [str(dump_dir)] if dump_dir else ["--state-dir", str(state_dir)]
    return json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)


FINAL = {"committed", "aborted", "cancelled", "failed"}
UNIT_FINAL = {"applied", "failed", "dropped"}


def assert_journal_final(state_dir, dump_dir=None):
    ctl = journal_json(state_dir=state_dir)
    for r in ctl["restores"]:
        assert r["state"] in FINAL and r["outcome"] == r["state"], r
        for u in r["units"]:
            assert u["state"] in UNIT_FINAL, r
    if dump_dir is not None:
        dj = journal_json(dump_dir=dump_dir)
        for r in dj["restores"]:
            assert r["state"] in FINAL, r
        for p in dj["publications"]:
            assert p["phase"] in ("cleaned", "failed", "rolled-back"), p
    return ctl


def make_dump(tq_start, tmp_path, n=24, units=4, select=None):
    """Fill a deployment, dump a subset; returns (keys, reference TensorDict, tags, dump_dir)."""
    tq_start(units)
    keys, td, tags = rollout_batch(n)
    tq.kv_batch_put(keys, "p", td, tags=tags)
    tq.kv_put("tag-only", "p", None, tag={"status": "running", "v": torch.tensor([7])})
    sel = select if select is not None else [k for i, k in enumerate(keys) if i % 3]
    ref = tq.kv_batch_get(sel, "p")
    tq.dump_data_by_key(tmp_path / "dump", sel + ["tag-only"], "p")
    reftags = {k: t for k, t in zip(keys, tags)}
    return sel, ref, reftags, tmp_path / "dump"


# Fewer units after than before runs in the quick tier; the other shapes (more, the same
# count, growing from one and from two) in the full suite.
@pytest.mark.parametrize("before,after", [(4, 2), pytest.param(2, 4, marks=pytest.mark.slow),
                                          pytest.param(3, 3, marks=pytest.mark.slow),
                                          pytest.param(1, 4, marks=pytest.mark.slow)])
def test_restore_across_unit_counts_round_trips_exactly(tq_start, tmp_path, before, after):
    sel, ref, reftags, dump = make_dump(tq_start, tmp_path, units=before)
    cfg = tq_start(after)
    tq.kv_put("bystander", "other", {"z": torch.arange(5)}, tag={"b": 1})
    rep = tq.load_data_by_key(dump)
    assert rep["keys"] == len(sel) + 1 and rep["new_keys"] == len(sel) + 1
    assert rep["rows_with_data"] == len(sel)
    assert {"restore_id", "keys", "new_keys", "rows_with_data", "shards", "bytes", "units",
            "seconds"} <= set(rep)
    got = tq.kv_batch_get(sel, "p")
    assert_same_rows(ref, got, sel)
    listed = tq.kv_list()
    assert set(listed["p"]) == set(sel) | {"tag-only"}  # only the selected keys
    for k in sel:
        assert_same_value(listed["p"][k], reftags[k], k)
    assert_same_value(listed["p"]["tag-only"], {"status": "running", "v": torch.tensor([7])})
    assert torch.equal(tq.kv_batch_get(["bystander"], "other")["z"][0], torch.arange(5))
    ctl = assert_journal_final(cfg["state_dir"], dump)
    assert [r["state"] for r in ctl["restores"]] == ["committed"]


def test_merge_keeps_indexes_other_fields_and_bystanders(tq_start, tmp_path):
    sel, ref, reftags, dump = make_dump(tq_start, tmp_path, units=2, select=["s1", "s2"])
    tq_start(2)
    # existing key s1 with an extra field and a different value, plus a bystander
    tq.kv_put("s1", "p", {"obs": torch.zeros(4), "extra": torch.tensor([9])},
              tag={"status": "old", "mine": True})
    tq.kv_put("s9", "p", {"obs": torch.ones(4)}, tag={"x": 1})
    client = tq.get_client()
    idx_before = client.controller.call("LOOKUP", {"partition_id": "p", "keys": ["s1", "s9"]})[
        "indexes"]
    rep = tq.load_data_by_key(dump)
    assert rep["new_keys"] == 2  # s2 and tag-only
    idx_after = client.controller.call("LOOKUP", {"partition_id": "p", "keys": ["s1", "s9"]})[
        "indexes"]
    assert idx_before == idx_after
    got = tq.kv_batch_get(["s1"], "p", select_fields=["obs", "extra"])
    assert torch.equal(got["obs"][0], ref["obs"][0])  # loaded field overwrote
    assert got["extra"][0].item() == 9  # other field stayed
    tags = tq.kv_list("p")["p"]
    assert tags["s1"]["mine"] is True and tags["s1"]["status"] == reftags["s1"]["status"]
    assert tags["s9"] == {"x": 1}
    assert torch.equal(tq.kv_batch_get(["s9"], "p")["obs"][0], torch.ones(4))
    # partition override
    tq.load_data_by_key(dump, partition_id="elsewhere")
    assert set(tq.kv_list("elsewhere")["elsewhere"]) == {"s1", "s2", "tag-only"}


def _corrupt_cases(dump):
    shard = sorted((dump / "shards").glob("*.bin"))[0]
    index = sorted((dump / "shards").glob("*.index"))[0]
    manifest = dump / "dump_info.json"

    def missing_manifest():
        manifest.unlink()
        return "dump_info.json"

    def missing_shard():
        shard.unlink()
        return shard.name

    def truncated_shard():
        shard.write_bytes(shard.read_bytes()[:-10])
        return shard.name

    def unknown_version():
        m = json.loads(manifest.read_text())
        m["format_version"] = 99
        manifest.write_text(json.dumps(m))
        return "dump_info.json"

    def out_of_range_offset():
        from tqtx.wire.codec import packb, unpackb
        data = unpackb(index.read_bytes())
        data["records"][0][1] += 1 << 30
        raw = packb(data)
        index.write_bytes(raw)
        m = json.loads(manifest.read_text())
        for s in m["shards"]:
            if s["index"]["file"].endswith(index.name):
                s["index"]["size"], s["index"]["crc32"] = len(raw), fmt.checksum(raw)
        manifest.write_text(json.dumps(m))
        return shard.name

    def corrupt_shard_byte():
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x55
        shard.write_bytes(bytes(data))
        return shard.name

    return {"missing_manifest": missing_manifest, "missing_shard": missing_shard,
            "truncated_shard": truncated_shard, "unknown_version": unknown_version,
            "out_of_range_offset": out_of_range_offset, "corrupt_shard_byte": corrupt_shard_byte}


@pytest.mark.parametrize("case", ["missing_manifest", "missing_shard", "truncated_shard",
                                  "unknown_version", "out_of_range_offset",
                                  "corrupt_shard_byte"])
def test_bad_dump_is_refused_with_no_visible_change(tq_shared, pid, tmp_path, case):
    keys, td, tags = rollout_batch(12)
    tq.kv_batch_put(keys, pid, td, tags=tags)
    tq.dump_data_by_key(tmp_path / "dump", keys, pid)
    # the live keys now hold other values: a failed restore must leave these in place
    keys2, td2, tags2 = rollout_batch(12, seed=5)
    tq.kv_batch_put(keys, pid, td2, tags=tags2)
    before_list = tq.kv_list(pid)
    named = _corrupt_cases(tmp_path / "dump")[case]()
    with pytest.raises((ValueError, RuntimeError)) as ei:
        tq.load_data_by_key(tmp_path / "dump")
    assert named in str(ei.value)
    assert_same_rows(td2, tq.kv_batch_get(keys, pid), keys)
    assert_same_value(before_list, tq.kv_list(pid), "tags")
    assert tq.list_restores(pid) == []
    assert_journal_final(tq_shared["state_dir"])


def test_incompatible_schema_is_refused_before_anything(tq_shared, pid, tmp_path):
    tq.kv_put("a", pid, {"x": torch.ones(3)})
    tq.dump_data_by_key(tmp_path / "d", ["a"], pid)
    tq.kv_put("b", pid + "-2", {"x": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="'x'.*dtype"):
        tq.load_data_by_key(tmp_path / "d", partition_id=pid + "-2")
    tq.kv_put("c", pid + "-3", {"x": "text"})
    with pytest.raises(ValueError, match="'x'"):
        tq.load_data_by_key(tmp_path / "d", partition_id=pid + "-3")
    assert set(tq.kv_list(pid + "-2")[pid + "-2"]) == {"b"}
    ctl = journal_json(state_dir=tq_shared["state_dir"])
    assert not [r for r in ctl["restores"] if r["partition_id"] in (pid + "-2", pid + "-3")]


@pytest.mark.parametrize("fault,error,message", [
    pytest.param("unit.load.after_stage:raise", RuntimeError,
                 "fault injected at unit.load.after_stage", id="unit.load.after_stage:raise"),
    pytest.param("unit.load.after_claim:kill", PeerDiedError,
                 r"unit 1 at \S+ is gone .* while waiting for the reply to LOAD_ROWS",
                 id="unit.load.after_claim:kill", marks=pytest.mark.slow),
])
def test_unit_failing_mid_load_leaves_no_visible_change(tq_start, tmp_path, fault, error, message):
    sel, ref, reftags, dump = make_dump(tq_start, tmp_path, units=2)
    cfg = tq_start(2, unit_env={1: {"TQTX_FAULTS": fault}})
    # s1 exists with another value; the failed restore must leave it
    tq.kv_put("s1", "p", {"obs": torch.full((4,), 3.0)}, tag={"status": "mine"})
    with pytest.raises(error, match=message):
        tq.load_data_by_key(dump)
    assert set(tq.kv_list("p")["p"]) == {"s1"}
    assert torch.equal(tq.kv_batch_get(["s1"], "p")["obs"][0], torch.full((4,), 3.0))
    assert tq.kv_list("p")["p"]["s1"] == {"status": "mine"}
    ctl = assert_journal_final(cfg["state_dir"], dump)
    assert [r["state"] for r in ctl["restores"]] == ["aborted"]
    st = tq.get_client().unit(0).call("STATS")
    assert st["staged_restores"] == []
    if "raise" in fault:
        # with the faulty unit fine again, the same dump loads (the partition is not blocked)
        tq_start(2)
        tq.load_data_by_key(dump)
        assert_same_rows(ref, tq.kv_batch_get(sel, "p"), sel)


@pytest.mark.slow
def test_lost_finish_reply_is_retried_and_publishes_once(tq_start, tmp_path):
    sel, ref, reftags, dump = make_dump(tq_start, tmp_path, units=2)
    cfg = tq_start(2, timeout=3.0, env={"TQTX_FAULTS": "controller.reply.FINISH_RESTORE@1:drop-reply"})
    rep = tq.load_data_by_key(dump)
    assert_same_rows(ref, tq.kv_batch_get(sel, "p"), sel)
    ctl = assert_journal_final(cfg["state_dir"], dump)
    assert [r["state"] for r in ctl["restores"]] == ["committed"]
    assert rep["restore_id"] == ctl["restores"][0]["restore_id"]
    assert len(tq.kv_list("p")["p"]) == len(sel) + 1


def _slow_unit_restore(tq_start, tmp_path, delay=6.0):
    sel, ref, reftags, dump = make_dump(tq_start, tmp_path, units=2)
    cfg = tq_start(2, timeout=1.5, unit_env={1: {"TQTX_FAULTS": f"unit.load.after_claim:delay:{delay}"}})
    t0 = time.monotonic()
    with pytest.raises(RestorePendingError) as ei:
        tq.load_data_by_key(dump)
    err = ei.value
    assert err.reason == "unit_running" and err.restore_id and err.units.get(1) == "claimed"
    assert "recover_data_load" in str(err) and "unresolved" in str(err)
    return sel, ref, dump, cfg, t0 + delay


def _wait_load_replied(unit: int, deadline: float) -> None:
    """Until ``unit`` has answered a LOAD_ROWS (its STATS count requests once replied)."""
    peer = tq.get_client().unit(unit)
    while not peer.call("STATS")["ops"].get("LOAD_ROWS", {}).get("count"):
        assert time.monotonic() < deadline, f"unit {unit} never answered its LOAD_ROWS"
        time.sleep(0.1)


@pytest.mark.slow
def test_claimed_unit_outlives_client_timeout_then_recovers(tq_start, tmp_path):
    sel, ref, dump, cfg, ready_at = _slow_unit_restore(tq_start, tmp_path)
    # blocked while unresolved: new keys, clears, a second load, dump over it, checkpoints
    for action in (lambda: tq.kv_put("new-key", "p", {"obs": torch.ones(4)}),
                   lambda: tq.kv_clear(["tag-only"], "p"),
                   lambda: tq.load_data_by_key(dump),
                   lambda: tq.dump_data_by_key(dump, [], "other"),
                   lambda: tq.save_checkpoint(tmp_path / "ckpt"),
                   lambda: tq.recover_data_load(dump)):
        with pytest.raises(RestorePendingError) as ei:
            action()
        assert "unresolved" in str(ei.value) and "recover_data_load" in str(ei.value)
    # other partitions keep working
    tq.kv_put("free", "other", {"a": torch.ones(1)})
    tq.kv_clear(["free"], "other")
    # recover_data_load refuses while the slow unit still loads, then settles the restore
    deadline = ready_at + 30
    while True:
        try:
            settled = tq.recover_data_load(dump)
            break
        except RestorePendingError as exc:
            assert time.monotonic() < deadline, exc
            time.sleep(0.2)
    assert settled is True
    assert_same_rows(ref, tq.kv_batch_get(sel, "p"), sel)
    ctl = assert_journal_final(cfg["state_dir"], dump)
    assert [r["state"] for r in ctl["restores"]] == ["committed"]
    assert tq.recover_data_load(dump) is True  # nothing pending


@pytest.mark.slow
def test_cancelled_restore_late_unit_cannot_write(tq_start, tmp_path):
    sel, ref, dump, cfg, ready_at = _slow_unit_restore(tq_start, tmp_path, delay=4.0)
    assert tq.recover_data_load(dump, cancel=True) is False
    _wait_load_replied(1, ready_at + 30)  # the late unit went through with its load
    assert "p" not in tq.kv_list() or set(tq.kv_list("p").get("p", {})) == set()
    for u in range(2):
        assert tq.get_client().unit(u).call("STATS")["staged_restores"] == []
    ctl = assert_journal_final(cfg["state_dir"], dump)
    assert [r["state"] for r in ctl["restores"]] == ["cancelled"]
    # and the dump can now be loaded normally
    tq_start(2)
    tq.load_data_by_key(dump)
    assert_same_rows(ref, tq.kv_batch_get(sel, "p"), sel)


def test_whole_system_restart_aborts_unresolved_then_load_just_works(tq_start, tmp_path):
    sel, ref, dump, cfg, ready_at = _slow_unit_restore(tq_start, tmp_path, delay=30.0)
    kill_whole_job()  # the whole job dies with the restore unresolved
    cfg2 = tq_start(2, state_dir=cfg["state_dir"])
    rep = tq.load_data_by_key(dump)
    assert rep["keys"] == len(sel) + 1
    assert_same_rows(ref, tq.kv_batch_get(sel, "p"), sel)
    ctl = assert_journal_final(cfg2["state_dir"], dump)
    states = {r["restore_id"]: (r["state"], r["reason"]) for r in ctl["restores"]}
    assert sorted(s for s, _ in states.values()) == ["aborted", "committed"]
    assert ("aborted", "controller restarted") in states.values()
    assert any(e["action"] == "aborted" for e in ctl.get("recovery_events", []))


@pytest.mark.slow  # quick tier: the whole-job restart test above (same set-up)
def test_unknown_restore_needs_cancel(tq_start, tmp_path):
    import shutil
    sel, ref, dump, cfg, ready_at = _slow_unit_restore(tq_start, tmp_path, delay=30.0)
    kill_whole_job()
    shutil.rmtree(cfg["state_dir"])  # the controller journal is lost
    tq_start(2, state_dir=cfg["state_dir"])
    with pytest.raises(RestorePendingError) as ei:
        tq.load_data_by_key(dump)
    assert ei.value.reason == "unknown_restore"
    assert tq.recover_data_load(dump, cancel=True) is False
    tq.load_data_by_key(dump)
    assert_same_rows(ref, tq.kv_batch_get(sel, "p"), sel)
    assert_journal_final(cfg["state_dir"], dump)
