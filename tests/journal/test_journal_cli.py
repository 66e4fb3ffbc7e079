"""``tqtx journal`` click group: show (--json contract), recover, migrate, check."""
from __future__ import annotations

import json
import sqlite3

import pytest
from click.testing import CliRunner
from filelock import FileLock

from tqtx.cli.journal import journal
from tqtx.journal.migrate import migrate
from tqtx.journal.controller import ControllerJournal
from tqtx.journal.dump import DumpJournal
from tqtx.layout.paths import controller_journal_path, dump_journal_path


@pytest.fixture
def runner():
    return CliRunner()


def invoke(runner, *args, env=None):
    return runner.invoke(journal, list(map(str, args)), env=env, catch_exceptions=False)


@pytest.fixture
def populated(tmp_path):
    """A controller journal with one committed and one half-finished restore, a dump, and
    the dump's own journal with one publication and one restore row."""
    state, dump = tmp_path / "state", tmp_path / "ckpt" / "buf"
    with ControllerJournal(state) as j:
        inc = j.start_incarnation(pid=4242, host="node1", address="tcp://node1:5555",
                                  version="0.1.0")
        j.begin_restore(restore_id="r-ok", partition_id="train", dump_dir=str(dump),
                        dump_id="d1", incarnation_id=inc, units=[0, 1], keys=4, rows=8, bytes=64)
        for u in (0, 1):
            j.claim_unit("r-ok", u)
            j.stage_unit("r-ok", u, rows=4, bytes=32)
        j.decide_commit("r-ok")
        for u in (0, 1):
            j.apply_unit("r-ok", u)
        j.finish_restore("r-ok", "committed")
        j.begin_restore(restore_id="r-half", partition_id="val", dump_dir=str(dump),
                        dump_id="d1", incarnation_id=inc, units=[0], keys=1, rows=1, bytes=8)
        j.claim_unit("r-half", 0)
        j.record_dump(dump_id="d1", dump_dir=str(dump), partition_id="train", keys=4,
                      rows_with_data=8, bytes=64, shards=2, incarnation_id=inc)
    with DumpJournal(dump) as dj:
        dj.begin_publication(attempt_id="a1", kind="dump", dump_id="d1",
                             staging_dir=str(dump) + ".tmp-a1")
        for phase in ("written", "synced", "old-moved", "published", "cleaned"):
            dj.set_phase("a1", phase)
        dj.begin_restore(restore_id="r-half", controller_address="tcp://node1:5555",
                         incarnation_id=inc, controller_state_dir=str(state), partition_id="val")
    return state, dump


def test_show_json_controller(runner, populated):
    state, dump = populated
    res = invoke(runner, "show", "--state-dir", state, "--json")
    assert res.exit_code == 0
    out = json.loads(res.output)
    assert set(out) == {"journal", "kind", "restores", "publications", "incarnations", "dumps",
                        "recovery_events", "buffer", "controller"}
    assert out["controller"] == {"running": False, "incarnation": 1, "pid": 4242,
                                 "host": "node1", "address": "tcp://node1:5555",
                                 "ended_at": None}
    assert out["journal"] == str(state / "journal.sqlite") and out["kind"] == "controller"
    assert out["buffer"] == []  # no keys journaled in this state dir
    half, ok = out["restores"]  # newest first
    ts = {"created_at", "finished_at"}
    assert set(ok) == {"restore_id", "partition_id", "dump_dir", "state", "outcome", "reason",
                       "keys", "rows", "bytes", "created_at", "finished_at", "units"}
    assert {k: v for k, v in ok.items() if k not in ts} == {
        "restore_id": "r-ok", "partition_id": "train", "dump_dir": str(dump),
        "state": "committed", "outcome": "committed", "reason": None, "keys": 4, "rows": 8,
        "bytes": 64, "units": [
            {"unit_id": 0, "state": "applied", "rows": 4, "bytes": 32, "error": None},
            {"unit_id": 1, "state": "applied", "rows": 4, "bytes": 32, "error": None}]}
    assert ok["finished_at"] >= ok["created_at"]
    assert {k: v for k, v in half.items() if k not in ts} == {
        "restore_id": "r-half", "partition_id": "val", "dump_dir": str(dump), "state": "active",
        "outcome": None, "reason": None, "keys": 1, "rows": 1, "bytes": 8, "units": [
            {"unit_id": 0, "state": "claimed", "rows": 0, "bytes": 0, "error": None}]}
    assert half["finished_at"] is None
    [pub] = out["publications"]
    assert set(pub) == {"dump_dir", "attempt_id", "kind", "dump_id", "phase", "error",
                        "created_at", "updated_at"}
    assert (pub["dump_dir"], pub["attempt_id"], pub["kind"], pub["dump_id"], pub["phase"],
            pub["error"]) == (str(dump), "a1", "dump", "d1", "cleaned", None)
    [inc] = out["incarnations"]
    assert {k: inc[k] for k in ("id", "pid", "host", "address", "version", "state_dir",
                                "ended_at")} == {
        "id": 1, "pid": 4242, "host": "node1", "address": "tcp://node1:5555",
        "version": "0.1.0", "state_dir": str(state), "ended_at": None}
    [d] = out["dumps"]
    assert {k: v for k, v in d.items() if k != "created_at"} == {
        "dump_id": "d1", "dump_dir": str(dump), "partition_id": "train", "keys": 4,
        "rows_with_data": 8, "bytes": 64, "shards": 2, "incarnation_id": 1}
    assert out["recovery_events"] == []


def test_show_json_filters(runner, populated):
    state, _ = populated
    out = json.loads(invoke(runner, "show", "--state-dir", state, "--json", "--state",
                            "committed").output)
    assert [r["restore_id"] for r in out["restores"]] == ["r-ok"]
    out = json.loads(invoke(runner, "show", "--state-dir", state, "--json", "--restore",
                            "r-half").output)
    assert [r["restore_id"] for r in out["restores"]] == ["r-half"]
    out = json.loads(invoke(runner, "show", "--json", "--limit", "1",
                            env={"TQTX_STATE_DIR": str(state)}).output)
    assert [r["restore_id"] for r in out["restores"]] == ["r-half"]


def test_show_json_dump(runner, populated):
    _, dump = populated
    res = invoke(runner, "show", dump, "--json")
    assert res.exit_code == 0
    out = json.loads(res.output)
    assert out["journal"] == str(dump_journal_path(dump)) and out["kind"] == "dump"
    [r] = out["restores"]
    assert {k: v for k, v in r.items() if k != "created_at"} == {
        "restore_id": "r-half", "partition_id": "val", "dump_dir": str(dump), "state": "reading",
        "outcome": None, "reason": None, "keys": None, "rows": None, "bytes": None,
        "finished_at": None, "units": []}
    [p] = out["publications"]
    assert (p["dump_dir"], p["attempt_id"], p["phase"]) == (str(dump), "a1", "cleaned")
    assert out["recovery_events"] == []


def test_show_tables(runner, populated):
    state, dump = populated
    res = invoke(runner, "show", "--state-dir", state)
    assert res.exit_code == 0
    for word in ("restores (2)", "r-half", "dumps (1)", "publications (1)", "incarnations (1)",
                 "recovery events (0)"):
        assert word in res.output
    res = invoke(runner, "show", dump)
    assert res.exit_code == 0 and "r-half" in res.output


def test_show_missing_does_not_create(runner, tmp_path):
    res = runner.invoke(journal, ["show", "--state-dir", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "no journal" in res.output
    assert not (tmp_path / "nope").exists()
    res = runner.invoke(journal, ["show", str(tmp_path / "buf"), "--json"])
    assert res.exit_code == 1
    assert list(tmp_path.iterdir()) == []
    # With DUMP_DIR, --state-dir is where a read-only dump's journal would be kept.
    res = runner.invoke(journal, ["show", str(tmp_path / "buf"), "--state-dir", str(tmp_path)])
    assert res.exit_code == 1 and "no journal" in res.output
    assert list(tmp_path.iterdir()) == []


def test_recover_state_dir(runner, populated):
    state, dump = populated
    res = invoke(runner, "recover", "--state-dir", state, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [(a["kind"], a["target"], a["action"]) for a in out["actions"]] == [
        ("restore", "r-half", "dump-journal-aborted"), ("restore", "r-half", "aborted")]
    with ControllerJournal(state) as j:
        r = j.get_restore("r-half")
        assert (r["state"], r["reason"]) == ("aborted", "controller restarted")
        assert [u["state"] for u in r["units"]] == ["dropped"]
        cli_inc = j.list_incarnations()[0]
        assert cli_inc["address"] == "cli" and cli_inc["ended_at"] is not None
        assert len(j.list_recovery_events()) == 2
    with DumpJournal(dump) as dj:
        assert dj.get_restore("r-half")["state"] == "aborted"
    res = invoke(runner, "recover", "--state-dir", state)
    assert res.exit_code == 0 and "nothing to recover" in res.output
    out = json.loads(invoke(runner, "show", "--state-dir", state, "--json").output)
    assert [e["action"] for e in out["recovery_events"]] == ["aborted", "dump-journal-aborted"]


def test_recover_refuses_live_controller(runner, populated):
    state, _ = populated
    with FileLock(str(state / "controller.lock")):
        res = runner.invoke(journal, ["recover", "--state-dir", str(state)])
    assert res.exit_code == 1 and "live controller" in res.output
    with ControllerJournal(state) as j:
        assert j.get_restore("r-half")["state"] == "active"


def test_recover_dump_dir(runner, tmp_path):
    """Recovery settles journaled debris only: an unjournaled ``.old`` / ``.tmp-*`` stays."""
    dump = tmp_path / "buf"
    (tmp_path / "buf.old").mkdir()
    (tmp_path / "buf.old" / "f").write_text("old")
    (tmp_path / "buf.tmp-x").mkdir()
    res = invoke(runner, "recover", dump)
    assert res.exit_code == 0 and "nothing to recover" in res.output
    assert (tmp_path / "buf.old" / "f").read_text() == "old"
    assert (tmp_path / "buf.tmp-x").is_dir() and not dump.exists()

    # A crash after moving the old dump aside, journaled: recovery puts it back.
    (tmp_path / "buf.old").rename(dump)
    with DumpJournal(dump) as j:
        j.begin_publication(attempt_id="a2", kind="dump", dump_id=None,
                            staging_dir=str(dump) + ".tmp-a2")
        j.set_phase("a2", "synced")
    (tmp_path / "buf.tmp-a2").mkdir()
    dump.rename(tmp_path / "buf.old")
    res = invoke(runner, "recover", dump)
    assert res.exit_code == 0 and "rolled-back" in res.output
    assert (dump / "f").read_text() == "old"
    assert not (tmp_path / "buf.tmp-a2").exists() and (tmp_path / "buf.tmp-x").is_dir()
    assert "nothing to recover" in invoke(runner, "recover", dump).output


def test_migrate_and_check(runner, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    path = controller_journal_path(state)
    assert runner.invoke(journal, ["check", "--state-dir", str(state)]).exit_code == 1
    assert runner.invoke(journal, ["migrate", "--state-dir", str(state)]).exit_code == 1
    migrate(path, "controller", "c0001")
    res = runner.invoke(journal, ["check", "--state-dir", str(state), "--json"])
    assert res.exit_code == 1
    out = json.loads(res.output)
    assert (out["revision"], out["head"], out["ok"]) == ("c0001", "c0008", False)
    res = invoke(runner, "migrate", "--state-dir", state)
    assert "c0001 -> c0008" in res.output
    res = invoke(runner, "check", "--state-dir", state)
    assert res.exit_code == 0 and "ok" in res.output
    assert "already at c0008" in invoke(runner, "migrate", "--state-dir", state).output

    dump = tmp_path / "buf"
    DumpJournal(dump).close()
    assert invoke(runner, "check", dump).exit_code == 0

    # A dangling foreign key (written with enforcement off) is reported.
    con = sqlite3.connect(path)
    con.execute("INSERT INTO restores (restore_id, partition_id, dump_dir, incarnation_id, "
                "state, created_at, updated_at) VALUES ('x', 'p', '/d', 99, 'active', 't', 't')")
    con.commit()
    con.close()
    res = runner.invoke(journal, ["check", "--state-dir", str(state), "--json"])
    assert res.exit_code == 1
    assert json.loads(res.output)["foreign_key_errors"] == [["restores", 1, "incarnations", 0]]


def test_show_reads_while_a_writer_holds_the_journal_lock(runner, populated):
    """A live controller mid-write (here: a connection holding BEGIN IMMEDIATE) does not
    make ``show`` wait out SQLite's busy timeout and fail calling the journal damaged."""
    state, _dump = populated
    con = sqlite3.connect(state / "journal.sqlite", isolation_level=None)
    try:
        con.execute("BEGIN IMMEDIATE")
        con.execute("INSERT INTO meta_counters (name, value) VALUES ('held', 1)")
        res = invoke(runner, "show", "--state-dir", state, "--json")
        assert res.exit_code == 0, res.output
        assert [r["restore_id"] for r in json.loads(res.output)["restores"]] == ["r-half", "r-ok"]
    finally:
        con.execute("ROLLBACK")
        con.close()


def test_show_names_a_dump_journal_it_cannot_read_and_exits_1(runner, populated):
    state, dump = populated
    (dump.parent / "buf.journal.sqlite").write_bytes(b"not a database" * 100)
    res = runner.invoke(journal, ["show", "--state-dir", str(state), "--json"])
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    assert out["unreadable"] == [{"journal": str(dump) + ".journal.sqlite",
                                  "error": "DatabaseError: file is not a database"}]
    assert len(out["restores"]) == 2  # the rest is printed
    assert "cannot read the dump journal" in res.stderr and "Traceback" not in res.output
    res = runner.invoke(journal, ["show", str(dump)])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert res.stderr.startswith("error: cannot read the dump journal ") and \
        "damaged dump journal (file is not a database)" in res.stderr, res.stderr


def test_show_says_whether_the_controller_runs(runner, populated):
    state, _dump = populated
    res = invoke(runner, "show", "--state-dir", state, "--layout", "records")
    assert "running controller\n  running:     no\n" in res.output
    assert "did not end cleanly" in res.output  # incarnation 1 never ended
    with FileLock(str(state / "controller.lock")):  # what a live controller holds
        out = json.loads(invoke(runner, "show", "--state-dir", state, "--json").output)
    assert out["controller"]["running"] is True
