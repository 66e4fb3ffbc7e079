"""Roll-forward from the dump (issue 12, item 3): a unit that restarts after staging -- or
after applying, before the restore is published -- comes back empty; the committed restore
re-reads that unit's rows from the dump before any key becomes visible. Real processes."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

import tqtx as tq
from buffers import assert_same_value, rollout_batch, rows_of
from tqtx import RestorePendingError, api

# These tests compare dense columns and expect KeysNotFoundError for missing keys:
# tqtx's strict mode (docs/compatibility.md); the fence is the same in both modes.
pytestmark = pytest.mark.strict

N_UNITS = 3


def journal_json(state_dir=None, dump_dir=None) -> dict:
    args = ["tqtx", "journal", "show", "--json"]
    args += [str(dump_dir)] if dump_dir else ["--state-dir", str(state_dir)]
    return json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)


def make_dump(tq_start, tmp_path):
    """12 rollout rows and a tag-only key dumped from a 3-unit deployment."""
    tq_start(N_UNITS)
    keys, td, tags = rollout_batch(12)
    tq.kv_batch_put(keys, "p", td, tags=tags)
    tq.kv_put("tag-only", "p", None, tag={"status": "running"})
    ref = dict(zip(keys, rows_of(tq.kv_batch_get(keys, "p"))))
    dump = tmp_path / "dump"
    tq.dump_data_by_key(dump, keys + ["tag-only"], "p")
    return ref, str(dump)


def assert_every_listed_key_readable(ref: dict) -> set:
    """The invariant: every listed key's row reads back, with the dump's values."""
    listed = tq.kv_list("p").get("p", {})
    with_rows = [k for k in listed if k in ref]
    if with_rows:
        got = dict(zip(with_rows, rows_of(tq.kv_batch_get(with_rows, "p"))))
        for k in with_rows:
            for f, v in ref[k].items():
                assert_same_value(v, got[k][f], f"{k}.{f}")
    return set(listed)


def crash_one_unit(tq_start, tmp_path, fault: str):
    """Restore onto 3 units with ``fault`` armed on unit 0 and return once the commit is
    decided but unit 0 is dead (the load reports the restore pending)."""
    ref, dump = make_dump(tq_start, tmp_path)
    cfg = tq_start(N_UNITS, unit_env={0: {"TQTX_FAULTS": fault}})
    with pytest.raises(RestorePendingError) as ei:
        tq.load_data_by_key(dump)
    assert ei.value.reason == "apply_pending", ei.value
    assert api._deployment.procs["unit 0"].wait(timeout=10) is not None, "unit 0 should have died"
    rec = journal_json(state_dir=cfg["state_dir"])["restores"][0]
    assert rec["state"] == "committing", rec
    # nothing of the restore is visible while a unit has not applied
    assert tq.kv_list("p").get("p", {}) == {}
    api._deployment.restart_unit(0)          # comes back empty
    tq.get_client().refresh_topology()
    return ref, dump, cfg


@pytest.mark.parametrize("fault", ["unit.request.APPLY_STAGED:kill",
                                   pytest.param("unit.apply.after_apply:kill",
                                                marks=pytest.mark.slow)])
def test_unit_back_empty_is_rolled_forward_from_the_dump(tq_start, tmp_path, fault):
    ref, dump, cfg = crash_one_unit(tq_start, tmp_path, fault)
    assert tq.recover_data_load(dump) is True
    listed = assert_every_listed_key_readable(ref)
    assert listed == set(ref) | {"tag-only"}
    assert tq.kv_list("p")["p"]["tag-only"] == {"status": "running"}
    ctl = journal_json(state_dir=cfg["state_dir"])
    (rec,) = ctl["restores"]
    assert rec["state"] == "committed", rec
    assert {u["unit_id"]: u["state"] for u in rec["units"]} == {0: "applied", 1: "applied",
                                                                2: "applied"}
    events = [e for e in ctl["recovery_events"] if e["target"] == rec["restore_id"]]
    assert [e["action"] for e in events] == ["unit-redone"], events
    assert events[0]["detail"].startswith("unit 0: re-read 4 rows from " + dump)
    assert [r["state"] for r in journal_json(dump_dir=dump)["restores"]] == ["committed"]
    assert tq.get_client().unit(0).call("STATS")["staged_restores"] == []


def _break_dump(dump: str, how: str) -> str:
    """Damage the dump; returns a text the failure must name."""
    if how == "removed":
        shutil.move(dump, dump + "-moved-away")
        return dump
    from pathlib import Path
    shard = sorted((Path(dump) / "shards").glob("*.bin"))[0]
    shutil.copy2(shard, str(shard) + ".good")
    data = bytearray(shard.read_bytes())
    for i in range(len(data) // 8, len(data), max(1, len(data) // 8)):
        data[i] ^= 0x55   # every unit's records hold some damaged bytes
    shard.write_bytes(bytes(data))
    return shard.name


def _repair_dump(dump: str, how: str) -> None:
    if how == "removed":
        shutil.move(dump + "-moved-away", dump)
        return
    from pathlib import Path
    for good in (Path(dump) / "shards").glob("*.bin.good"):
        shutil.move(str(good), str(good)[:-len(".good")])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["removed", pytest.param("corrupted", marks=pytest.mark.slow)])
def test_dump_gone_keeps_restore_committing_with_a_precise_reason(tq_start, tmp_path, how):
    ref, dump, cfg = crash_one_unit(tq_start, tmp_path, "unit.request.APPLY_STAGED:kill")
    named = _break_dump(dump, how)
    with pytest.raises(RestorePendingError) as ei:
        tq.recover_data_load(dump)
    err = ei.value
    assert err.reason == "redo_failed" and err.dump_dir == dump, err
    assert named in str(err) and "recover_data_load" in str(err) and "cancel=True" in str(err)
    rec = journal_json(state_dir=cfg["state_dir"])["restores"][0]
    assert rec["state"] == "committing" and rec["reason"].startswith(f"redo_failed: {dump}: "), rec
    assert named in rec["reason"]
    # no key is listed whose row is not readable: none of the restore is visible
    assert assert_every_listed_key_readable(ref) == set()
    # put the dump back: the same call rolls the restore forward
    _repair_dump(dump, how)
    assert tq.recover_data_load(dump) is True
    assert assert_every_listed_key_readable(ref) == set(ref) | {"tag-only"}
    assert journal_json(state_dir=cfg["state_dir"])["restores"][0]["state"] == "committed"


@pytest.mark.slow
def test_dump_gone_for_good_can_be_given_up_as_failed(tq_start, tmp_path):
    ref, dump, cfg = crash_one_unit(tq_start, tmp_path, "unit.request.APPLY_STAGED:kill")
    keep = tmp_path / "copy"
    shutil.copytree(dump, keep)
    named = _break_dump(dump, "corrupted")
    with pytest.raises(RestorePendingError):
        tq.recover_data_load(dump)
    assert tq.recover_data_load(dump, cancel=True) is False
    (rec,) = journal_json(state_dir=cfg["state_dir"])["restores"]
    assert rec["state"] == rec["outcome"] == "failed", rec
    assert rec["reason"].startswith(f"redo_failed: {dump}: ") and named in rec["reason"]
    assert "given up" in rec["reason"]
    assert [r["state"] for r in journal_json(dump_dir=dump)["restores"]] == ["failed"]
    assert tq.kv_list("p").get("p", {}) == {}
    client = tq.get_client()
    for u in range(N_UNITS):  # the rows applied on units 1 and 2 were dropped with it
        st = client.unit(u).call("STATS")
        assert st["rows"] == 0 and st["staged_restores"] == [], (u, st)
    assert client.controller.call("STATS")["open_restores"] == []
    # nothing is blocked: a good copy of the dump loads
    tq.load_data_by_key(keep)
    assert assert_every_listed_key_readable(ref) == set(ref) | {"tag-only"}


@pytest.mark.slow
def test_unit_that_applied_then_restarted_is_rolled_forward_too(tq_start, tmp_path):
    # unit 0 dies before applying; units 1 and 2 apply (journaled applied), then unit 1
    # restarts too before the restore is published: its applied rows are gone as well
    ref, dump, cfg = crash_one_unit(tq_start, tmp_path, "unit.request.APPLY_STAGED:kill")
    states = {u["unit_id"]: u["state"]
              for u in journal_json(state_dir=cfg["state_dir"])["restores"][0]["units"]}
    assert states == {0: "staged", 1: "applied", 2: "applied"}, states
    proc = api._deployment.procs["unit 1"]
    proc.kill()
    proc.wait(10)
    api._deployment.restart_unit(1)
    tq.get_client().refresh_topology()
    assert tq.recover_data_load(dump) is True
    assert assert_every_listed_key_readable(ref) == set(ref) | {"tag-only"}
    ctl = journal_json(state_dir=cfg["state_dir"])
    redone = sorted(e["detail"].split(":")[0] for e in ctl["recovery_events"]
                    if e["action"] == "unit-redone")
    assert redone == ["unit 0", "unit 1"], ctl["recovery_events"]


@pytest.mark.slow
def test_unit_dying_during_the_redo_is_redone_again(tq_start, tmp_path):
    ref, dump, cfg = crash_one_unit(tq_start, tmp_path, "unit.request.APPLY_STAGED:kill")
    # the restarted unit 0 dies again, after re-reading its rows, before staging them
    proc = api._deployment.procs["unit 0"]
    proc.kill()
    proc.wait(10)
    api._deployment.restart_unit(0, env={"TQTX_FAULTS": "unit.redo.after_read:kill"})
    tq.get_client().refresh_topology()
    with pytest.raises(RestorePendingError) as ei:
        tq.recover_data_load(dump)
    assert ei.value.reason == "apply_pending", ei.value
    assert api._deployment.procs["unit 0"].wait(timeout=10) is not None
    assert tq.kv_list("p").get("p", {}) == {}
    api._deployment.restart_unit(0)
    tq.get_client().refresh_topology()
    assert tq.recover_data_load(dump) is True
    assert assert_every_listed_key_readable(ref) == set(ref) | {"tag-only"}
