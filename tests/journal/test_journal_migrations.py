"""Alembic chains of both journals: from empty, from the earlier revision, concurrent opens."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from filelock import FileLock

from tqtx.journal.models import ControllerBase, DumpBase
from tqtx.journal.migrate import head_revision, make_engine, migrate, migrations_dir
from tqtx.journal.controller import ControllerJournal
from tqtx.journal.dump import DumpJournal
from tqtx.layout.paths import controller_journal_path, dump_journal_path


def tables(path) -> set[str]:
    con = sqlite3.connect(path)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        con.close()


def test_layout():
    root = migrations_dir()
    assert (root / "env.py").is_file() and (root / "script.py.mako").is_file()
    assert head_revision("controller") == "c0008"
    assert head_revision("dump") == "d0002"


@pytest.mark.parametrize("chain,base,path_of", [
    ("controller", ControllerBase, controller_journal_path),
    ("dump", DumpBase, dump_journal_path)])
def test_upgrade_from_empty_matches_models(tmp_path, chain, base, path_of):
    path = path_of(tmp_path / "x")
    path.parent.mkdir(parents=True, exist_ok=True)
    assert migrate(path, chain) == (None, head_revision(chain))
    assert migrate(path, chain) == (head_revision(chain), head_revision(chain))
    assert tables(path) == set(base.metadata.tables) | {"alembic_version"}
    engine = make_engine(path, wal=chain == "controller")
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), base.metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_controller_upgrade_preserves_rows(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    path = controller_journal_path(state)
    assert migrate(path, "controller", "c0001") == (None, "c0001")
    assert "recovery_events" not in tables(path)
    con = sqlite3.connect(path)
    with con:
        con.execute("INSERT INTO incarnations (id, started_at, pid, host, address, version, "
                    "state_dir) VALUES (7, '2024-01-01T00:00:00+00:00', 42, 'h', 'tcp://h:1', "
                    "'0.0.9', '/s')")
        con.execute("INSERT INTO restores (restore_id, partition_id, dump_dir, dump_id, "
                    "incarnation_id, state, keys, rows, created_at, updated_at) VALUES "
                    "('r1', 'train', '/d/buf', 'd1', 7, 'active', 5, 6, 't0', 't0')")
        con.execute("INSERT INTO restore_units (restore_id, unit_id, state, rows, created_at, "
                    "updated_at) VALUES ('r1', 0, 'claimed', 3, 't0', 't0')")
        con.execute("INSERT INTO dumps (dump_id, dump_dir, partition_id, keys, rows_with_data, "
                    "bytes, shards, incarnation_id, created_at) VALUES "
                    "('d1', '/d/buf', 'train', 5, 5, 1000, 2, 7, 't0')")
    con.close()

    with ControllerJournal(state) as j:
        assert j.revision() == "c0008"
        r = j.get_restore("r1")
        assert {k: r[k] for k in ("partition_id", "dump_dir", "dump_id", "incarnation_id",
                                  "state", "keys", "rows", "bytes")} == {
            "partition_id": "train", "dump_dir": "/d/buf", "dump_id": "d1", "incarnation_id": 7,
            "state": "active", "keys": 5, "rows": 6, "bytes": 0}
        assert r["units"] == [{"unit_id": 0, "state": "claimed", "rows": 3, "bytes": 0,
                               "error": None}]
        assert j.list_dumps()[0]["bytes"] == 1000
        assert j.list_incarnations()[0]["pid"] == 42
        # The upgraded journal is fully usable, including the new table.
        j.stage_unit("r1", 0, rows=3, bytes=30)
        j.record_recovery(incarnation_id=7, kind="restore", target="r1", action="noted")
        assert len(j.list_recovery_events()) == 1


def test_request_answers_keep_their_order_across_the_seq_key(tmp_path):
    """c0008 keys meta_requests by seq: the recorded answers survive the upgrade (a resent
    request is still answered by a successor controller), in seq order, and new ones append
    after them; the downgrade restores the request ID key."""
    from alembic import command
    from tqtx.journal import migrate as jm
    from tqtx.journal.meta import MetaJournal
    state = tmp_path / "state"
    state.mkdir()
    path = controller_journal_path(state)
    assert migrate(path, "controller", "c0007") == (None, "c0007")
    con = sqlite3.connect(path)
    with con:
        con.executemany("INSERT INTO meta_requests (request_id, seq, reply) VALUES (?, ?, ?)",
                        [("r-b", 2, b"second"), ("r-a", 1, b"first"), ("r-c", 3, b"third")])
    con.close()
    with ControllerJournal(state) as j:
        assert j.revision() == "c0008"
        mj = MetaJournal(j.engine, "controller")
        try:
            assert mj.load()["answered"] == [("r-a", b"first"), ("r-b", b"second"),
                                             ("r-c", b"third")]
            from tqtx.journal.meta import MetaChange
            mj.write(MetaChange(next_index=1, answered=("r-d", b"fourth")))
            assert [a[0] for a in mj.load()["answered"]] == ["r-a", "r-b", "r-c", "r-d"]
        finally:
            mj.close()
    con = sqlite3.connect(path)
    try:
        cols = [(r[1], r[5]) for r in con.execute("PRAGMA table_info(meta_requests)")]
        assert ("seq", 1) in cols  # the primary key (the row ID)
        assert not [r for r in con.execute("PRAGMA index_list(meta_requests)")]
    finally:
        con.close()
    engine = make_engine(path, wal=True)
    try:
        with engine.begin() as conn:
            command.downgrade(jm.alembic_config("controller", conn), "c0007")
    finally:
        engine.dispose()
    con = sqlite3.connect(path)
    try:
        assert con.execute("SELECT request_id, seq FROM meta_requests ORDER BY seq").fetchall() \
            == [("r-a", 1), ("r-b", 2), ("r-c", 3), ("r-d", 4)]
        assert {r[1] for r in con.execute("PRAGMA index_list(meta_requests)")} >= {
            "ix_meta_requests_seq"}
    finally:
        con.close()


def test_dump_upgrade_preserves_rows(tmp_path):
    dump = tmp_path / "buf"
    path = dump_journal_path(dump)
    assert migrate(path, "dump", "d0001") == (None, "d0001")
    con = sqlite3.connect(path)
    with con:
        con.execute("INSERT INTO publications (attempt_id, kind, dump_id, staging_dir, phase, "
                    "created_at, updated_at) VALUES ('a1', 'dump', 'd1', '/s', 'synced', 't0', 't0')")
        con.execute("INSERT INTO restores (restore_id, controller_address, incarnation_id, "
                    "partition_id, state, created_at, updated_at) VALUES "
                    "('r1', 'tcp://h:1', 3, 'train', 'reading', 't0', 't0')")
    con.close()
    with DumpJournal(dump) as dj:
        assert dj.revision() == "d0002"
        assert dj.unfinished_publications() == [
            {"attempt_id": "a1", "kind": "dump", "dump_id": "d1", "staging_dir": "/s",
             "phase": "synced", "error": None, "created_at": "t0", "updated_at": "t0"}]
        r = dj.get_restore("r1")
        assert (r["state"], r["controller_state_dir"], r["incarnation_id"]) == ("reading", None, 3)
        dj.set_phase("a1", "rolled-back", "recovered")


def test_migration_waits_for_migrate_lock(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    path = controller_journal_path(state)
    lock = FileLock(str(path) + ".migrate.lock")
    code = textwrap.dedent(f"""
        import time
        from tqtx.journal.controller import ControllerJournal
        ControllerJournal({str(state)!r}).close()
        print(time.time())
    """)
    with lock:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        _wait_until_exists(proc, path)  # it is at the lock, which is held
        released = time.time()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and float(out) >= released  # it waited for the migrate lock


def _wait_until_exists(proc, path, timeout: float = 60.0) -> None:
    """Return once ``path`` exists (the opener's engine made the database file: it checks
    the stamp, then takes the migrate lock), failing if ``proc`` ended first."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, "the opener ended before it reached the lock"
        assert time.monotonic() < deadline, f"the opener never made {path}"
        time.sleep(0.01)


OPENER = textwrap.dedent("""
    import sys, time
    from tqtx.journal.controller import ControllerJournal
    from tqtx.journal.dump import DumpJournal
    kind, target, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
    while time.time() < start:
        time.sleep(0.001)
    if kind == "controller":
        with ControllerJournal(target) as j:
            j.start_incarnation(pid=0, host="h", address="a", version="v")
            print(j.revision())
    else:
        with DumpJournal(target) as j:
            j.begin_publication(attempt_id=str(time.time_ns()) + sys.argv[4], kind="dump",
                                dump_id=None, staging_dir="s")
            print(j.revision())
""")


@pytest.mark.parametrize("kind", ["controller", "dump"])
def test_concurrent_open_of_fresh_journal(tmp_path, kind):
    target = tmp_path / ("state" if kind == "controller" else "buf")
    n = 3
    start = time.time() + 2.0  # after every interpreter has imported sqlalchemy/alembic
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, kind, str(target), str(start),
                               str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(n)]
    results = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "locked" not in err
        assert out.strip() == head_revision(kind)
    if kind == "controller":
        with ControllerJournal(target) as j:
            assert len(j.list_incarnations()) == n
    else:
        with DumpJournal(target) as j:
            assert len(j.publications()) == n
    con = sqlite3.connect(controller_journal_path(target) if kind == "controller"
                          else dump_journal_path(target))
    assert con.execute("SELECT count(*) FROM alembic_version").fetchone()[0] == 1
    con.close()
    # the controller's journal is created under the migrate lock; a new dump journal under
    # SQLite's write lock alone (migrate.create_head_plain): no lock file beside the dump
    assert os.path.exists(str(controller_journal_path(target) if kind == "controller"
                              else dump_journal_path(target)) + ".migrate.lock") == \
        (kind == "controller")


# --------------------------------------------------------------------------- fast creation
def _checks(sql: str) -> set[str]:
    """Named CHECK constraints of a CREATE TABLE statement, normalized."""
    out, low = set(), " ".join(sql.replace('"', "").split()).lower()
    pos = 0
    while True:
        k = low.find(" check (", pos)
        if k < 0:
            return out
        depth, end = 0, k + 7
        for end in range(k + 7, len(low)):
            depth += {"(": 1, ")": -1}.get(low[end], 0)
            if depth == 0:
                break
        name = low[:k].rsplit("constraint ", 1)[-1].split()[0] if "constraint " in low[:k] else ""
        out.add(name + ":" + low[k + 7:end + 1].replace(" ", ""))
        pos = end


def _schema(path):
    """Columns, indexes, foreign keys and CHECK constraints per table (order-insensitive)."""
    import sqlite3
    con = sqlite3.connect(path)
    try:
        out = {}
        tables = con.execute("SELECT name, sql FROM sqlite_master WHERE type='table' "
                             "AND name NOT LIKE 'sqlite_%'").fetchall()
        for name, sql in tables:
            cols = sorted((r[1], r[2].upper(), r[3], r[4], r[5])
                          for r in con.execute(f"PRAGMA table_info('{name}')"))
            idx = sorted((r[1], r[2], tuple(c[2] for c in con.execute(f"PRAGMA index_info('{r[1]}')")))
                         for r in con.execute(f"PRAGMA index_list('{name}')")
                         if not r[1].startswith("sqlite_autoindex"))
            uniq = sorted(tuple(c[2] for c in con.execute(f"PRAGMA index_info('{r[1]}')"))
                          for r in con.execute(f"PRAGMA index_list('{name}')") if r[2])
            fks = sorted(tuple(r[2:5]) for r in con.execute(f"PRAGMA foreign_key_list('{name}')"))
            out[name] = {"columns": cols, "indexes": idx, "unique": uniq, "fks": fks,
                         "checks": sorted(_checks(sql))}
        return out
    finally:
        con.close()


def test_heads_constant_matches_the_migration_scripts():
    from tqtx.journal import migrate as jm
    for chain in (jm.CONTROLLER, jm.DUMP):
        assert jm.HEADS[chain] == jm.head_revision(chain)


@pytest.mark.parametrize("chain", ["controller", "dump"])
def test_fresh_journal_from_models_equals_the_migrated_schema(tmp_path, chain):
    """New journals are created from the models and stamped; that must be the same
    schema as running every migration from an empty database."""
    from tqtx.journal import migrate as jm
    fast = tmp_path / "fast.sqlite"
    slow = tmp_path / "slow.sqlite"
    jm.migrate(fast, chain)  # empty -> create_all + stamp
    engine = jm.make_engine(slow, wal=(chain == "controller"))
    try:
        with engine.begin() as conn:
            from alembic import command
            command.upgrade(jm.alembic_config(chain, conn), f"{chain}@head")
    finally:
        engine.dispose()
    assert _schema(fast) == _schema(slow)


@pytest.mark.parametrize("chain,base", [("controller", ControllerBase), ("dump", DumpBase)])
def test_precompiled_schema_is_create_all_and_at_the_alembic_head(tmp_path, chain, base):
    """A new journal runs the statements of head_schema_sql (compiled once per process):
    the same tables and indexes, statement for statement, as create_all of the models,
    and stamped at the head alembic itself reports."""
    from tqtx.journal import migrate as jm
    fast, ref = tmp_path / "fast.sqlite", tmp_path / "ref.sqlite"
    assert jm.migrate(fast, chain) == (None, head_revision(chain))
    engine = make_engine(ref, wal=chain == "controller")
    try:
        with engine.begin() as conn:
            base.metadata.create_all(conn)
    finally:
        engine.dispose()

    def ddl(path):
        con = sqlite3.connect(path)
        try:
            return sorted(con.execute("SELECT type, name, sql FROM sqlite_master "
                                      "WHERE tbl_name != 'alembic_version'").fetchall())
        finally:
            con.close()

    assert ddl(fast) == ddl(ref)
    engine = make_engine(fast, wal=chain == "controller")
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn)
            assert ctx.get_current_heads() == (head_revision(chain),)
            assert compare_metadata(ctx, base.metadata) == []
    finally:
        engine.dispose()
    # and a DumpJournal opened on a new directory is that journal
    if chain == "dump":
        with DumpJournal(tmp_path / "new") as j:
            assert j.revision() == head_revision("dump")
        assert ddl(dump_journal_path(tmp_path / "new")) == ddl(ref)


@pytest.mark.parametrize("chain", ["controller", "dump"])
def test_precompiled_head_schema_is_what_the_models_compile_to(chain):
    """tqtx/journal/head_schema.py is regenerated (python -m tqtx.journal.head_schema)
    whenever the models change."""
    from tqtx.journal import head_schema
    assert head_schema.HEAD_SCHEMA_SQL[chain] == head_schema.compiled(chain)
