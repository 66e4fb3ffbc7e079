"""Opening a journal file: the SQLite engine with tqtx's pragmas (or a plain sqlite3
connection with the same pragmas, :class:`PlainConnection`), and Alembic migrations.

Two chains of revisions live in ``migrations/`` (package ``tqtx.migrations``): ``controller``
and ``dump``. There is no ``alembic.ini``; :func:`alembic_config` builds the Config in code,
and alembic itself is imported only when a journal is not at the head of its chain.
"""
from __future__ import annotations

import functools
import importlib.resources
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, OperationalError

from ..layout.paths import migrate_lock_path

CONTROLLER = "controller"
DUMP = "dump"
BUSY_TIMEOUT_MS = 30000


# --------------------------------------------------------------------------- engine


def make_engine(path: str | os.PathLike, *, wal: bool, readonly: bool = False) -> Engine:
    """SQLite engine whose connections set the journal pragmas and begin with BEGIN IMMEDIATE.

    Pragmas: ``busy_timeout=30000``, ``journal_mode=WAL`` (``PERSIST`` when ``wal`` is false:
    a rollback journal, safe on network filesystems, whose file is kept and zeroed rather
    than deleted at each commit -- ~10x cheaper than DELETE on this disk),
    ``synchronous=FULL``, ``foreign_keys=ON``.

    ``readonly`` (readers such as ``tqtx journal show``): the file is opened read-only, its
    journal mode is left as it is and transactions are plain (deferred) BEGINs, so a reader
    never waits for a writer holding the write lock (a live controller mid-write).
    """
    if readonly:
        url = URL.create("sqlite", database=f"file:{os.fspath(path)}?mode=ro",
                         query={"uri": "true"})
    else:
        url = URL.create("sqlite", database=os.fspath(path))
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        _configure(dbapi_conn, wal, readonly=readonly)

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")

    return engine


def _configure(dbapi_conn, wal: bool, *, readonly: bool = False) -> None:
    # pysqlite recipe: stop the driver from issuing its own BEGIN, so BEGIN IMMEDIATE (the
    # engine's "begin" event, or PlainConnection.transaction) starts every transaction.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    if readonly:  # the writers set the journal mode; a reader changes nothing
        cur.close()
        return
    _set_journal_mode(cur, "WAL" if wal else "PERSIST")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _set_journal_mode(cur, mode: str) -> None:
    """``PRAGMA journal_mode``, retried while another connection holds the lock it needs:
    SQLite answers "database is locked" at once there instead of waiting out busy_timeout
    (seen with three processes opening one new WAL journal), so it is retried here, with
    a growing pause, for at most that timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    pause = 0.001
    while True:
        try:
            cur.execute(f"PRAGMA journal_mode={mode}")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class PlainConnection:
    """A plain sqlite3 connection with :func:`make_engine`'s pragmas, for journals whose
    calls are a few small statements each; usable from any thread, one transaction at a
    time. Driver errors are raised as SQLAlchemy's (what callers of the engine catch)."""

    def __init__(self, path: str | os.PathLike, *, wal: bool, readonly: bool = False):
        self._lock = threading.Lock()
        self._begin = "BEGIN" if readonly else "BEGIN IMMEDIATE"
        target = f"file:{os.fspath(path)}?mode=ro" if readonly else os.fspath(path)
        self._conn = sqlite3.connect(target, timeout=BUSY_TIMEOUT_MS / 1000,
                                     check_same_thread=False, uri=readonly)
        try:
            _configure(self._conn, wal, readonly=readonly)
        except BaseException:
            self._conn.close()
            raise

    def run(self, sql: str, params=()):
        """``exec_driver_sql``'s convention: a list of tuples is an executemany."""
        try:
            if isinstance(params, list):
                return self._conn.executemany(sql, params)
            return self._conn.execute(sql, params)
        except sqlite3.Error as exc:
            raise DBAPIError.instance(sql, params, exc, sqlite3.Error) from None

    @contextmanager
    def transaction(self):
        """One BEGIN IMMEDIATE transaction; yields :meth:`run`."""
        with self._lock:
            if self._conn is None:
                raise RuntimeError("journal connection is closed")
            self.run(self._begin)
            try:
                yield self.run
                self.run("COMMIT")
            except BaseException:
                try:
                    self._conn.rollback()  # a no-op once COMMIT ended the transaction
                except sqlite3.Error:
                    pass  # the error that got us here is the one to see
                raise

    def stamp(self) -> str | None:
        """The alembic_version row (None for a database without one)."""
        return _stamped_revision(self)

    def exec_driver_sql(self, sql: str, params=()):  # what _stamped_revision calls
        return self.run(sql, params)

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def read_only_connection(path: str | os.PathLike) -> sqlite3.Connection:
    """A plain sqlite3 connection that only reads the journal at ``path``, without tqtx's
    pragmas: it never creates, migrates or writes it, and opens a damaged file so that it
    can be checked (sqlite3.Error where it cannot be opened)."""
    return sqlite3.connect(f"file:{os.fspath(path)}?mode=ro", uri=True,
                           timeout=BUSY_TIMEOUT_MS / 1000)


# --------------------------------------------------------------------------- migrations


def migrations_dir() -> Path:
    """Filesystem location of the alembic environment (package ``tqtx.migrations``)."""
    return Path(str(importlib.resources.files("tqtx.migrations")))


def alembic_config(chain: str, connection=None):
    """An in-memory alembic Config for ``chain`` ('controller' or 'dump'); no alembic.ini."""
    from alembic.config import Config  # alembic is imported lazily: opening is the rare path

    if chain not in (CONTROLLER, DUMP):
        raise ValueError(f"unknown journal chain {chain!r}")
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()).replace("%", "%%"))
    cfg.set_main_option("path_separator", "os")
    cfg.attributes["chain"] = chain
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.lru_cache(maxsize=None)
def head_revision(chain: str) -> str:
    """Head revision id of ``chain``."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config(chain))
    return script.get_revision(f"{chain}@head").revision


def _current(conn) -> str | None:
    from alembic.runtime.migration import MigrationContext

    heads = MigrationContext.configure(conn).get_current_heads()
    return heads[0] if len(heads) == 1 else (",".join(heads) or None)


def current_revision(engine: Engine) -> str | None:
    """Revision stamped in the database, or None for an empty database."""
    with engine.connect() as conn:
        return _current(conn)


# Head revision of each chain. Checked against the migration scripts by a test; lets a
# journal at head open without importing alembic (which costs ~0.4 s per process).
HEADS = {CONTROLLER: "c0008", DUMP: "d0002"}


def _stamped_revision(conn) -> str | None:
    """The alembic_version row, read with plain SQL (None for a database without one);
    ``conn``: an engine's connection or a :class:`PlainConnection`."""
    try:
        rows = conn.exec_driver_sql("SELECT version_num FROM alembic_version").fetchall()
    except OperationalError:
        return None
    return rows[0][0] if len(rows) == 1 else (",".join(r[0] for r in rows) or None)


def _is_empty(conn) -> bool:
    """No table in the database (``conn``: an engine's connection or a PlainConnection)."""
    return conn.exec_driver_sql(
        "SELECT count(*) FROM sqlite_master WHERE type='table'").fetchone()[0] == 0


def _create_head(conn, chain: str) -> None:
    """Create ``chain``'s head schema and stamp it, inside ``conn``'s open transaction."""
    for stmt in head_schema_sql(chain):
        conn.exec_driver_sql(stmt)
    conn.exec_driver_sql("INSERT INTO alembic_version (version_num) VALUES (?)",
                         (HEADS[chain],))


def _metadata(chain: str):
    from . import models
    return models.ControllerBase.metadata if chain == CONTROLLER else models.DumpBase.metadata


_VERSION_TABLE = ("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
                  "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))")


def head_schema_sql(chain: str) -> tuple[str, ...]:
    """The statements creating ``chain``'s head schema, as ``create_all`` of the models
    emits them (tables in dependency order, each followed by its indexes) plus alembic's
    version table: precompiled in :mod:`tqtx.journal.head_schema` (checked against the
    models by a test), so a new journal costs a few plain statements, without importing
    the ORM or compiling anything."""
    from .head_schema import HEAD_SCHEMA_SQL
    return HEAD_SCHEMA_SQL[chain]


def warm(chain: str = DUMP) -> None:
    """Do the once-per-process work of opening a new ``chain`` journal ahead of time:
    compile its schema and run it once through the SQLite driver (in memory)."""
    engine = create_engine("sqlite://")
    try:
        with engine.begin() as conn:
            for stmt in head_schema_sql(chain):
                conn.exec_driver_sql(stmt)
            _stamped_revision(conn)
    finally:
        engine.dispose()


def upgrade_engine(engine: Engine, db_path: str | os.PathLike, chain: str,
                   revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade the database behind ``engine`` to ``revision`` of ``chain``.

    Serialized across processes by ``<db>.migrate.lock``; the whole upgrade runs in one
    BEGIN IMMEDIATE transaction. A brand-new journal going to head is created from the
    models (:func:`head_schema_sql`) and stamped (the same schema the migrations build,
    proven by a test), which keeps alembic off the path of every dump to a new directory.
    Returns (revision before, revision after).
    """
    target_id = HEADS[chain] if revision == "head" else revision
    with engine.connect() as conn:
        before = _stamped_revision(conn)
    if before == target_id:
        return before, before
    created = False
    with FileLock(os.fspath(migrate_lock_path(db_path))):
        with engine.begin() as conn:
            before = _stamped_revision(conn)
            if before == target_id:
                return before, before
            if before is None and revision == "head" and _is_empty(conn):
                _create_head(conn, chain)
                created = True
            else:
                from alembic import command

                target = f"{chain}@head" if revision == "head" else revision
                command.upgrade(alembic_config(chain, conn), target)
    if created:  # committed just above: no need to read the stamp back
        return before, target_id
    with engine.connect() as conn:
        return before, _stamped_revision(conn)


def migrate(db_path: str | os.PathLike, chain: str, revision: str = "head"
            ) -> tuple[str | None, str | None]:
    """Create or upgrade the journal file ``db_path`` to ``revision`` of ``chain``."""
    engine = make_engine(db_path, wal=(chain == CONTROLLER))
    try:
        return upgrade_engine(engine, db_path, chain, revision)
    finally:
        engine.dispose()


def open_plain(path: str | os.PathLike, chain: str, *, wal: bool,
               upgrade: bool = True, readonly: bool = False) -> PlainConnection:
    """A :class:`PlainConnection` to the journal ``path``; with ``upgrade`` the file is first
    brought to the head of ``chain`` (:func:`migrate`) unless its stamp, read on every open
    (one statement: a file replaced since the last open is checked like any other), is
    already the head."""
    conn = PlainConnection(path, wal=wal, readonly=readonly)
    try:
        if upgrade and not readonly and conn.stamp() != HEADS[chain] and not create_head_plain(conn, chain):
            migrate(path, chain)
    except BaseException:
        conn.close()
        raise
    return conn


def create_head_plain(conn: PlainConnection, chain: str) -> bool:
    """Create ``chain``'s head schema in the empty database behind ``conn``, in one
    BEGIN IMMEDIATE transaction (SQLite's write lock serializes concurrent creators, and
    the stamp is read again under it); True if the database is now at head. False for a
    database that holds tables but no head stamp: that one goes through :func:`migrate`.

    A dump to a new directory creates its journal this way: no SQLAlchemy engine, no
    ``.migrate.lock`` file, a few plain statements."""
    with conn.transaction():
        stamp = _stamped_revision(conn)
        if stamp == HEADS[chain]:
            return True
        if stamp is not None or not _is_empty(conn):
            return False
        _create_head(conn, chain)
    return True


def check_file(path: str | os.PathLike, chain: str) -> dict:
    """Integrity, foreign-key and revision checks on the ``chain`` journal at ``path``,
    read-only: ``{"integrity", "foreign_key_errors", "revision", "head", "problems"}``."""
    con = read_only_connection(path)
    problems: list[str] = []
    try:
        integrity = [r[0] for r in con.execute("PRAGMA integrity_check")]
        if integrity != ["ok"]:
            problems += [f"integrity: {m}" for m in integrity]
        fk = [list(r) for r in con.execute("PRAGMA foreign_key_check")]
        problems += [f"foreign key: table {t} rowid {rid} -> {parent}" for t, rid, parent, _ in fk]
        try:
            revs = [r[0] for r in con.execute("SELECT version_num FROM alembic_version")]
        except sqlite3.Error:
            revs = []
    finally:
        con.close()
    head = head_revision(chain)
    current = ",".join(revs) or None
    if current != head:
        problems.append(f"revision {current or 'none'} is not head {head}")
    return {"integrity": integrity, "foreign_key_errors": fk, "revision": current,
            "head": head, "problems": problems}
