"""Controller/dump journal state machines, pragmas, constraints and startup replay."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from tqtx import faults
from tqtx.controller.startup import recover_controller_journal
from tqtx.journal.publish import Publication, dump_lock
from tqtx.journal.controller import ControllerJournal
from tqtx.journal.dump import DumpJournal
from tqtx.states import IllegalTransition
from tqtx.layout.paths import controller_journal_path, default_state_dir, dump_journal_path


@pytest.fixture
def cj(tmp_path):
    with ControllerJournal(tmp_path / "state") as j:
        yield j


def inc(j: ControllerJournal, pid: int = 100) -> int:
    return j.start_incarnation(pid=pid, host="h", address="tcp://h:1", version="0.1.0")


def begin(j, rid="r1", inc_id=None, units=(0, 1), dump_dir="/x/buf"):
    return j.begin_restore(restore_id=rid, partition_id="train", dump_dir=dump_dir, dump_id="d1",
                           incarnation_id=inc_id if inc_id is not None else inc(j),
                           units=list(units), keys=10, rows=20, bytes=300)


# ----------------------------------------------------------------------------- pragmas


def _pragmas(engine) -> dict:
    with engine.connect() as conn:
        return {p: conn.exec_driver_sql(f"PRAGMA {p}").scalar()
                for p in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")}


def test_controller_pragmas(cj):
    assert _pragmas(cj.engine) == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1,
                                   "busy_timeout": 30000}
    assert cj.path == controller_journal_path(cj.state_dir)


def test_dump_pragmas(tmp_path):
    with DumpJournal(tmp_path / "ckpt" / "buf") as dj:
        assert dj.path == tmp_path / "ckpt" / "buf.journal.sqlite"
        assert _pragmas(dj.engine) == {"journal_mode": "persist", "synchronous": 2,
                                       "foreign_keys": 1, "busy_timeout": 30000}
    assert not (tmp_path / "ckpt" / "buf").exists()  # the journal is a sibling


def test_dump_journal_plain_connection(tmp_path):
    """The dump journal's calls run on one plain sqlite3 connection: BEGIN IMMEDIATE,
    driver errors raised as SQLAlchemy's, a failed transaction rolled back, and the stamp
    checked on every open (a journal replaced by an old or foreign file is caught)."""
    from sqlalchemy.exc import OperationalError

    from tqtx.errors import DumpFormatError
    dump = tmp_path / "buf"
    with DumpJournal(dump) as dj:
        with dj._sql() as run:  # holds the write lock from its start
            other = sqlite3.connect(dj.path, timeout=0, isolation_level=None)
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
            other.close()
        with pytest.raises(OperationalError, match="no such table"):
            with dj._sql() as run:
                run("SELECT * FROM nowhere")
        with pytest.raises(RuntimeError, match="boom"):
            with dj._sql() as run:
                run("INSERT INTO publications (attempt_id, kind, staging_dir, phase, created_at, "
                    "updated_at) VALUES ('a1', 'dump', '/x', 'staging', 't', 't')")
                raise RuntimeError("boom")
        assert dj.get_publication("a1") is None  # rolled back; the connection still works
        assert dj.revision() == "d0002"
    path = dump_journal_path(dump)
    path.unlink()
    with DumpJournal(dump) as dj:  # a new file: created and stamped again
        assert dj.revision() == "d0002" and dj.publications() == []
    path.unlink()
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(DumpFormatError, match="damaged dump journal"):
        DumpJournal(dump)
    path.unlink()
    con = sqlite3.connect(path)  # a foreign SQLite file with no alembic stamp
    con.execute("CREATE TABLE publications (x)")
    con.close()
    with pytest.raises(DumpFormatError, match="table publications already exists"):
        DumpJournal(dump)  # as before: the migrations ran on it and failed


def test_transactions_begin_immediate(cj):
    # A transaction that only reads already holds the write lock (BEGIN IMMEDIATE).
    with cj.engine.begin() as conn:
        conn.execute(text("SELECT 1 FROM restores")).all()
        other = sqlite3.connect(cj.path, timeout=0, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        other.close()


def test_default_state_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TQTX_STATE_DIR", str(tmp_path / "s"))
    assert default_state_dir() == tmp_path / "s"
    monkeypatch.delenv("TQTX_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "tqtx" / "default"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "tqtx" / "default"


# ----------------------------------------------------------------------------- restores


def test_restore_lifecycle(cj):
    i = inc(cj)
    r = begin(cj, inc_id=i)
    assert r["state"] == "active" and r["outcome"] is None and r["incarnation_id"] == i
    assert [(u["unit_id"], u["state"]) for u in r["units"]] == [(0, "pending"), (1, "pending")]
    # idempotent begin: the existing record, unchanged
    again = cj.begin_restore(restore_id="r1", partition_id="other", dump_dir="/y", dump_id=None,
                             incarnation_id=i, units=[5], keys=0, rows=0, bytes=0)
    assert again == r
    for u in (0, 1):
        assert cj.claim_unit("r1", u)["state"] == "claimed"
        assert cj.claim_unit("r1", u)["state"] == "claimed"  # idempotent
        cj.stage_unit("r1", u, rows=10, bytes=150)
    assert cj.decide_commit("r1")["state"] == "committing"
    assert cj.decide_commit("r1")["state"] == "committing"
    for u in (0, 1):
        assert cj.apply_unit("r1", u)["state"] == "applied"
    done = cj.finish_restore("r1", "committed")
    assert (done["state"], done["outcome"], done["reason"]) == ("committed", "committed", None)
    assert done["finished_at"] is not None
    assert cj.finish_restore("r1", "committed") == done  # idempotent
    assert cj.get_restore("r1")["units"] == [
        {"unit_id": 0, "state": "applied", "rows": 10, "bytes": 150, "error": None},
        {"unit_id": 1, "state": "applied", "rows": 10, "bytes": 150, "error": None}]
    assert cj.unresolved_restores() == []
    assert cj.get_restore("nope") is None


@pytest.mark.parametrize("outcome", ["aborted", "cancelled", "failed"])
def test_finish_active_drops_live_claims(cj, outcome):
    begin(cj, units=[0, 1, 2])
    cj.claim_unit("r1", 0)
    cj.claim_unit("r1", 1)
    cj.stage_unit("r1", 1, rows=1, bytes=1)
    cj.fail_unit("r1", 2, "disk full")
    r = cj.finish_restore("r1", outcome, reason="why")
    assert (r["state"], r["outcome"], r["reason"]) == (outcome, outcome, "why")
    assert [(u["state"], u["error"]) for u in r["units"]] == [
        ("dropped", None), ("dropped", None), ("failed", "disk full")]


def test_illegal_restore_transitions(cj):
    begin(cj)
    with pytest.raises(IllegalTransition, match="'r1'.*active -> committed"):
        cj.finish_restore("r1", "committed")
    with pytest.raises(IllegalTransition, match=r"active -> committing \(not every claim"):
        cj.decide_commit("r1")
    with pytest.raises(IllegalTransition, match="not a final state"):
        cj.finish_restore("r1", "committing")
    for u in (0, 1):
        with pytest.raises(IllegalTransition, match=f"unit {u}: illegal transition pending -> staged"):
            cj.stage_unit("r1", u, rows=1, bytes=1)
        cj.claim_unit("r1", u)
        cj.stage_unit("r1", u, rows=1, bytes=1)
        with pytest.raises(IllegalTransition, match="staged -> applied while the restore is active"):
            cj.apply_unit("r1", u)
    cj.decide_commit("r1")
    with pytest.raises(IllegalTransition, match="committing -> cancelled"):
        cj.finish_restore("r1", "cancelled")
    with pytest.raises(IllegalTransition, match="committing -> aborted"):
        cj.finish_restore("r1", "aborted", reason="user asked")
    with pytest.raises(IllegalTransition, match="while the restore is committing"):
        cj.claim_unit("r1", 0)
    cj.apply_unit("r1", 0)
    with pytest.raises(IllegalTransition, match="unit 0: illegal transition applied -> dropped"):
        cj.drop_unit("r1", 0)
    cj.finish_restore("r1", "failed", reason="unit 1 died")
    with pytest.raises(IllegalTransition, match="failed -> committed"):
        cj.finish_restore("r1", "committed")
    with pytest.raises(IllegalTransition, match="failed -> aborted"):
        cj.finish_restore("r1", "aborted", reason="controller restarted")
    assert issubclass(IllegalTransition, ValueError)


def test_committing_aborted_only_on_restart(cj):
    begin(cj, units=[0])
    cj.claim_unit("r1", 0)
    cj.stage_unit("r1", 0, rows=1, bytes=1)
    cj.decide_commit("r1")
    with pytest.raises(IllegalTransition, match="committing -> aborted"):
        cj.finish_restore("r1", "aborted", reason="controller restarted")  # the reason is no key
    r = cj.abort_after_restart("r1")
    assert (r["outcome"], r["reason"]) == ("aborted", "controller restarted")
    assert r["units"][0]["state"] == "dropped"


def test_note_reason_on_a_committing_restore_then_failed(cj):
    begin(cj, units=[0])
    cj.claim_unit("r1", 0)
    cj.stage_unit("r1", 0, rows=1, bytes=1)
    cj.decide_commit("r1")
    r = cj.note_reason("r1", "redo_failed: /x/buf: unit 0: gone")
    assert r["state"] == "committing" and r["reason"] == "redo_failed: /x/buf: unit 0: gone"
    r = cj.finish_restore("r1", "failed", "redo_failed: /x/buf: unit 0: gone; given up")
    assert r["state"] == r["outcome"] == "failed" and r["units"][0]["state"] == "dropped"
    # a final restore keeps its reason
    assert cj.note_reason("r1", "other")["reason"].endswith("given up")


def test_claim_requires_active_restore(cj):
    begin(cj)
    cj.finish_restore("r1", "cancelled")
    with pytest.raises(IllegalTransition, match="'r1' unit 0.*while the restore is cancelled"):
        cj.claim_unit("r1", 0)
    with pytest.raises(KeyError):
        cj.claim_unit("r1", 9)
    with pytest.raises(KeyError):
        cj.claim_unit("zz", 0)


def test_claim_uniqueness_constraint(cj):
    begin(cj)
    raw = sqlite3.connect(cj.path)
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        raw.execute("INSERT INTO restore_units (restore_id, unit_id, state, created_at, updated_at)"
                    " VALUES ('r1', 0, 'pending', 't', 't')")
    raw.close()
    with cj.engine.begin() as conn, pytest.raises(IntegrityError):
        conn.execute(text("INSERT INTO restore_units (restore_id, unit_id, state, created_at, "
                          "updated_at) VALUES ('r1', 1, 'claimed', 't', 't')"))


def test_foreign_keys_and_checks_enforced(cj):
    with pytest.raises(IntegrityError):
        begin(cj, inc_id=999)
    begin(cj)
    with cj.engine.begin() as conn, pytest.raises(IntegrityError, match="CHECK"):
        conn.execute(text("UPDATE restores SET state = 'bogus'"))
    assert cj.get_restore("r1")["state"] == "active"


def test_lists_dumps_and_recovery_events(cj):
    i = inc(cj)
    begin(cj, "r1", i)
    begin(cj, "r2", i)
    cj.finish_restore("r1", "cancelled")
    assert [r["restore_id"] for r in cj.list_restores()] == ["r2", "r1"]
    assert [r["restore_id"] for r in cj.list_restores(state="active")] == ["r2"]
    assert [r["restore_id"] for r in cj.list_restores(restore_id="r1")] == ["r1"]
    assert len(cj.list_restores(limit=1)) == 1
    assert [r["restore_id"] for r in cj.unresolved_restores()] == ["r2"]
    d = cj.record_dump(dump_id="d1", dump_dir="/x/buf", partition_id="train", keys=3,
                       rows_with_data=3, bytes=99, shards=2, incarnation_id=i)
    assert cj.list_dumps() == [d] and d["bytes"] == 99 and d["shards"] == 2
    cj.record_recovery(incarnation_id=i, kind="restore", target="r1", action="aborted")
    ev = cj.list_recovery_events()
    assert [(e["kind"], e["target"], e["action"], e["detail"]) for e in ev] == [
        ("restore", "r1", "aborted", "")]
    with pytest.raises(ValueError):
        cj.record_recovery(incarnation_id=i, kind="bogus", target="x", action="y")
    cj.end_incarnation(i)
    assert cj.list_incarnations()[0]["ended_at"] is not None
    assert cj.list_incarnations(limit=1)[0]["id"] == i


def test_dump_journal_restores(tmp_path):
    with DumpJournal(tmp_path / "buf") as dj:
        r = dj.begin_restore(restore_id="r1", controller_address="tcp://h:1", incarnation_id=3,
                             controller_state_dir="/s", partition_id="train")
        assert r["state"] == "reading"
        assert dj.begin_restore(restore_id="r1", controller_address="x", incarnation_id=4,
                                controller_state_dir=None, partition_id="p") == r
        assert [x["restore_id"] for x in dj.active_restores()] == ["r1"]
        assert dj.finish_restore("r1", "committed")["state"] == "committed"
        dj.finish_restore("r1", "committed")
        with pytest.raises(IllegalTransition, match="committed -> aborted"):
            dj.finish_restore("r1", "aborted")
        with pytest.raises(IllegalTransition):
            dj.finish_restore("r1", "reading")
        assert dj.active_restores() == []
        assert dj.get_restore("r1")["controller_state_dir"] == "/s"


# ----------------------------------------------------------------------------- replay


def tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("phase,expect", [
    ("staging", "old"), ("written", "old"), ("synced", "old"), ("old_moved", "new"),
    ("published", "new"), ("cleaned", "new")])
def test_startup_replay(tmp_path, phase, expect):
    dump = tmp_path / "ckpt" / "buf"
    dump.mkdir(parents=True)
    (dump / "data").write_text("old")
    # only a tqtx dump (by its manifest) may be replaced by a publication
    (dump / "dump_info.json").write_text('{"format_version": 1, "dump_id": "d", '
                                         '"partition_id": "p", "row_index": {}, "shards": []}')
    state = tmp_path / "state"
    with ControllerJournal(state) as j:
        old_inc = inc(j, pid=1)
        begin(j, "r-half", old_inc, units=[0, 1], dump_dir=str(dump))
        j.claim_unit("r-half", 0)
        begin(j, "r-done", old_inc, units=[0], dump_dir=str(dump))
        j.finish_restore("r-done", "cancelled")
        # The dump journal: the restore was reading and a publication crashed at `phase`.
        with dump_lock(dump), DumpJournal(dump) as dj:
            dj.begin_restore(restore_id="r-half", controller_address="tcp://h:1",
                             incarnation_id=old_inc, controller_state_dir=str(state),
                             partition_id="train")
            faults.configure(f"publish.after_{phase}:raise")
            try:
                pub = Publication(dump, dump_id="d2", journal=dj)
                (pub.staging_dir / "data").write_text("new")
                pub.mark_written()
                pub.commit()
            except faults.InjectedFault:
                pass
            finally:
                faults.configure("")

    with ControllerJournal(state) as j:
        new_inc = inc(j, pid=2)
        begin(j, "r-mine", new_inc, dump_dir=str(dump))  # current incarnation: untouched
        actions = recover_controller_journal(j, incarnation_id=new_inc)
        r = j.get_restore("r-half")
        assert (r["state"], r["outcome"], r["reason"]) == ("aborted", "aborted",
                                                            "controller restarted")
        assert [u["state"] for u in r["units"]] == ["dropped", "dropped"]
        assert j.get_restore("r-done")["state"] == "cancelled"
        assert j.get_restore("r-mine")["state"] == "active"
        kinds = [(a["kind"], a["target"], a["action"]) for a in actions]
        assert kinds[0] == ("restore", "r-half", "dump-journal-aborted")
        assert kinds[-1] == ("restore", "r-half", "aborted")
        pub_actions = [a["action"] for a in actions[1:-1]]
        assert pub_actions == ({"old_moved": ["rolled-forward"], "published": ["cleaned"],
                                "cleaned": []}.get(phase, ["rolled-back"]))
        events = j.list_recovery_events()
        assert [(e["kind"], e["target"], e["action"], e["detail"]) for e in reversed(events)] == [
            (a["kind"], a["target"], a["action"], a["detail"]) for a in actions]
        assert all(e["incarnation_id"] == new_inc for e in events)
        assert recover_controller_journal(j, incarnation_id=new_inc) == []  # idempotent
    with DumpJournal(dump) as dj:
        assert dj.get_restore("r-half")["state"] == "aborted"
        assert dj.unfinished_publications() == []
    assert tree(dump)["data"] == expect
    assert sorted(p.name for p in dump.parent.iterdir()) == [
        "buf", "buf.journal.sqlite", "buf.journal.sqlite-journal", "buf.lock"]


def test_replay_leaves_a_dump_whose_lock_a_live_client_holds(cj, tmp_path, monkeypatch):
    """A client holding a dump's lock while it waits for the controller (a restore begun
    as the old controller died) must not stall the new one's startup until the client's
    request times out: the replay leaves that dump to its lock holder and still aborts the
    restores, which can never commit."""
    from filelock import FileLock
    from tqtx.controller import startup
    monkeypatch.setattr(startup, "DUMP_LOCK_WAIT", 0.05)
    dump = tmp_path / "buf"
    dump.mkdir()
    old = inc(cj)
    for rid in ("r1", "r2"):
        begin(cj, rid, old, units=[0], dump_dir=str(dump))
        with dump_lock(dump), DumpJournal(dump) as dj:
            dj.begin_restore(restore_id=rid, controller_address="tcp://h:1",
                             incarnation_id=old, controller_state_dir=str(cj.state_dir),
                             partition_id="train")
    holder = FileLock(str(dump_lock(dump).lock_file))  # another open file: another owner
    with holder:
        actions = recover_controller_journal(cj, incarnation_id=inc(cj))
    assert [(a["target"], a["action"]) for a in actions] == [
        ("r1", "dump-journal-busy"), ("r1", "aborted"),
        ("r2", "dump-journal-busy"), ("r2", "aborted")]
    assert "held by another process" in actions[0]["detail"]
    assert [cj.get_restore(r)["state"] for r in ("r1", "r2")] == ["aborted", "aborted"]
    with DumpJournal(dump) as dj:  # left to the lock holder and the dump's next reader
        assert sorted(r["restore_id"] for r in dj.active_restores()) == ["r1", "r2"]


def test_replay_survives_unreadable_dump_journal(cj, tmp_path):
    dump = tmp_path / "buf"
    dump_journal_path(dump).write_text("this is not a database")
    old = inc(cj)
    begin(cj, "r1", old, units=[0], dump_dir=str(dump))
    actions = recover_controller_journal(cj, incarnation_id=inc(cj))
    assert [a["action"] for a in actions] == ["dump-recovery-failed", "aborted"]
    assert cj.get_restore("r1")["state"] == "aborted"


def test_replay_without_dump_journal(cj):
    old = inc(cj)
    begin(cj, "r1", old, units=[0], dump_dir="/nonexistent/buf")
    cj.claim_unit("r1", 0)
    cj.stage_unit("r1", 0, rows=1, bytes=1)
    cj.decide_commit("r1")
    new = inc(cj)
    actions = recover_controller_journal(cj, incarnation_id=new)
    assert [(a["kind"], a["action"]) for a in actions] == [("restore", "aborted")]
    assert "was committing" in actions[0]["detail"]
    assert cj.get_restore("r1")["reason"] == "controller restarted"
    assert not dump_journal_path("/nonexistent/buf").exists()
