"""The dump journal, ``<dump_dir>.journal.sqlite`` (a rollback journal, which works on
network filesystems; alembic chain ``dump``): publication attempts of the dump and the
restores reading it."""
from __future__ import annotations

import os
import sqlite3
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.exc import DatabaseError

from .. import states as st
from ..layout.paths import records_location
from ..states import IllegalTransition, check
from .base import (_Journal, insert_row, journal_writes, open_error, restores_newest_first,
                   select_rows, sql_marks, utcnow)
from .migrate import DUMP, make_engine, open_plain, read_only_connection

_PUB_COLS = ("attempt_id", "kind", "dump_id", "staging_dir", "phase", "error", "created_at",
             "updated_at")
# Publication phases in which <dump>.old may be tqtx's (moved there by that attempt).
_OLD_PHASES = (st.SYNCED, st.OLD_MOVED, st.PUBLISHED)
_DRESTORE_COLS = ("restore_id", "controller_address", "incarnation_id", "controller_state_dir",
                  "partition_id", "state", "created_at", "updated_at")


class DumpJournal(_Journal):
    """Per-dump journal of publication attempts and of restores reading the dump."""

    _chain = DUMP
    _wal = False  # rollback journal: WAL needs shared memory, unusable on network filesystems

    @staticmethod
    def _damaged(message: str) -> Exception:
        from ..errors import DumpFormatError
        return DumpFormatError(message)

    def __init__(self, dump_dir: str | os.PathLike, *, migrate: bool = True,
                 state_dir: str | os.PathLike | None = None, path: str | os.PathLike | None = None,
                 readonly: bool = False):
        """Open (creating) the journal of ``dump_dir``: ``path`` if given, else where
        :func:`tqtx.layout.paths.records_location` puts it (beside the dump, or in ``state_dir``
        for a dump on read-only storage). ``readonly``: an existing journal, read without
        waiting for a writer (never created, migrated or written)."""
        self.dump_dir = Path(os.path.abspath(os.fspath(dump_dir)))
        journal = (Path(path) if path is not None
                   else records_location(self.dump_dir, state_dir)[1])
        if not readonly:
            journal.parent.mkdir(parents=True, exist_ok=True)
        self._open(journal, migrate, readonly)

    # A dump makes ~8 small transactions on its journal: they run on one plain sqlite3
    # connection (SQLAlchemy's layers cost several times the statements). An engine is
    # made only for callers of .engine.

    def _open(self, path: Path, migrate: bool, readonly: bool = False) -> None:
        self.path, self._engine, self._plain = path, None, None
        self._readonly = readonly
        try:
            self._plain = open_plain(path, self._chain, wal=self._wal, upgrade=migrate,
                                     readonly=readonly)
        except (sqlite3.DatabaseError, DatabaseError) as exc:
            raise open_error(exc, path, self._chain, self._damaged) from None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = make_engine(self.path, wal=self._wal, readonly=self._readonly)
        return self._engine

    @contextmanager
    def _sql(self):
        with journal_writes(self.path), self._plain.transaction() as run:
            yield run

    def stamp(self) -> str | None:
        return self._plain.stamp()

    def close(self) -> None:
        """Close the connection (and the engine's pool, if one was made)."""
        if self._plain is not None:
            self._plain.close()
        if self._engine is not None:
            self._engine.dispose()

    # read without opening ---------------------------------------------------------------
    # For callers that must never create, migrate or wait to write a dump journal: the
    # publish target check and ``tqtx journal show`` over the dumps a controller recorded.

    @staticmethod
    def read_publications(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
        """Publication attempts of the journal at ``path``, newest first, with every column
        the file has (one at an older revision too: it is not upgraded). sqlite3.Error
        where it cannot be read."""
        con = read_only_connection(path)
        try:
            cur = con.execute("SELECT * FROM publications ORDER BY created_at DESC, attempt_id "
                              "LIMIT ?", (-1 if limit is None else limit,))
            names = [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]
        finally:
            con.close()

    @staticmethod
    def accounts_for_old(path: str | os.PathLike) -> bool:
        """Does an unfinished publication in the journal at ``path`` say ``<dump>.old`` may
        be tqtx's (it moved the previous dump there)? False without a readable journal."""
        if not os.path.exists(path):
            return False
        try:
            con = read_only_connection(path)
        except sqlite3.Error:
            return False
        try:
            row = con.execute(f"SELECT count(*) FROM publications WHERE phase IN "
                              f"({sql_marks(_OLD_PHASES)})", _OLD_PHASES).fetchone()
            return bool(row and row[0])
        except sqlite3.Error:
            return False
        finally:
            con.close()

    # publications ---------------------------------------------------------------------

    def _publication_rows(self, run, where: str = "", params: tuple = ()) -> list[dict]:
        return select_rows(run, "publications", _PUB_COLS, where, params)

    def begin_publication(self, *, attempt_id: str, kind: str, dump_id: str | None,
                          staging_dir: str | os.PathLike) -> dict:
        """Record a publication attempt in phase ``staging`` (idempotent by attempt_id)."""
        if kind not in ("dump", "checkpoint"):
            raise ValueError(f"publication kind must be 'dump' or 'checkpoint', not {kind!r}")
        with self._sql() as run:
            found = self._publication_rows(run, "WHERE attempt_id = ?", (attempt_id,))
            if found:
                return found[0]
            now = utcnow()
            p = {"attempt_id": attempt_id, "kind": kind, "dump_id": dump_id,
                 "staging_dir": os.fspath(staging_dir), "phase": st.STAGING, "error": None,
                 "created_at": now, "updated_at": now}
            insert_row(run, "publications", _PUB_COLS, p)
            return p

    def set_phase(self, attempt_id: str, phase: str, error: str | None = None) -> dict:
        """Move a publication along :data:`tqtx.states.PUBLICATION`."""
        if phase not in st.PUBLICATION_PHASES:
            raise IllegalTransition(f"publication {attempt_id!r}: unknown phase {phase!r}")
        with self._sql() as run:
            found = self._publication_rows(run, "WHERE attempt_id = ?", (attempt_id,))
            if not found:
                raise KeyError(f"unknown publication attempt {attempt_id!r}")
            p = found[0]
            before = (p["phase"], p["error"])
            if check(st.PUBLICATION, p["phase"], phase, subject=f"publication {attempt_id!r}"):
                p["phase"], p["updated_at"] = phase, utcnow()
            if error is not None:
                p["error"] = error
            if (p["phase"], p["error"]) != before:  # a repeated move writes nothing
                run("UPDATE publications SET phase = ?, error = ?, updated_at = ? "
                    "WHERE attempt_id = ?", (p["phase"], p["error"], p["updated_at"], attempt_id))
            return p

    def get_publication(self, attempt_id: str) -> dict | None:
        """One publication attempt, or None."""
        with self._sql() as run:
            found = self._publication_rows(run, "WHERE attempt_id = ?", (attempt_id,))
        return found[0] if found else None

    def publications(self, limit: int | None = None) -> list[dict]:
        """Publication attempts, newest first."""
        with self._sql() as run:
            return self._publication_rows(run, "ORDER BY created_at DESC, attempt_id LIMIT ?",
                                          (-1 if limit is None else limit,))

    def unfinished_publications(self) -> list[dict]:
        """Publication attempts not in a final phase, oldest first."""
        final = tuple(st.PUBLICATION_FINAL)
        with self._sql() as run:
            return self._publication_rows(
                run, f"WHERE phase NOT IN ({sql_marks(final)}) "
                     "ORDER BY created_at, attempt_id", final)

    # restores -------------------------------------------------------------------------

    def _restore_row(self, run, restore_id: str) -> dict | None:
        found = select_rows(run, "restores", _DRESTORE_COLS, "WHERE restore_id = ?", (restore_id,))
        return found[0] if found else None

    def begin_restore(self, *, restore_id: str, controller_address: str,
                      incarnation_id: int | None, controller_state_dir: str | None,
                      partition_id: str) -> dict:
        """Record a restore reading this dump, state ``reading`` (idempotent by restore_id)."""
        with self._sql() as run:
            r = self._restore_row(run, restore_id)
            if r is None:
                now = utcnow()
                r = {"restore_id": restore_id, "controller_address": controller_address,
                     "incarnation_id": incarnation_id,
                     "controller_state_dir": (None if controller_state_dir is None
                                              else os.fspath(controller_state_dir)),
                     "partition_id": partition_id, "state": st.READING, "created_at": now,
                     "updated_at": now}
                insert_row(run, "restores", _DRESTORE_COLS, r)
            return r

    def finish_restore(self, restore_id: str, state: str) -> dict:
        """reading -> committed|aborted|cancelled|failed (same state again is a no-op)."""
        if state not in st.DUMP_RESTORE_FINAL:
            raise IllegalTransition(f"restore {restore_id!r}: {state!r} is not a final state")
        with self._sql() as run:
            r = self._restore_row(run, restore_id)
            if r is None:
                raise KeyError(f"unknown restore {restore_id!r}")
            if check(st.DUMP_RESTORE, r["state"], state, subject=f"restore {restore_id!r}"):
                r["state"], r["updated_at"] = state, utcnow()
                run("UPDATE restores SET state = ?, updated_at = ? WHERE restore_id = ?",
                    (state, r["updated_at"], restore_id))
            return r

    def get_restore(self, restore_id: str) -> dict | None:
        """One restore row, or None."""
        with self._sql() as run:
            return self._restore_row(run, restore_id)

    def list_restores(self, *, state: str | None = None, restore_id: str | None = None,
                      limit: int | None = None) -> list[dict]:
        """Restore rows, newest first."""
        tail, params = restores_newest_first(state, restore_id, limit)
        with self._sql() as run:  # plain SQL: every dump asks this (active_restores)
            return select_rows(run, "restores", _DRESTORE_COLS, tail, params)

    def active_restores(self) -> list[dict]:
        """Restores still ``reading``."""
        return list(reversed(self.list_restores(state=st.READING)))
