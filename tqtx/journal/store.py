"""Controller and dump journals: SQLite files with forward-only state machines.

* :class:`ControllerJournal` -- ``<state_dir>/journal.sqlite`` (WAL), alembic chain ``controller``.
* :class:`DumpJournal` -- ``<dump_dir>.journal.sqlite`` (rollback journal, works on network
  filesystems), alembic chain ``dump``.

Every connection gets the pragmas listed in :func:`tqtx.journal.migrate.make_engine`; every
transition is one ``BEGIN IMMEDIATE`` transaction, so concurrent writers from several
processes serialize on the SQLite write lock instead of failing on lock upgrade. Opening a
journal upgrades it to the head of its chain first, under a ``<db>.migrate.lock`` file lock
(a new, empty dump journal is created at head under SQLite's write lock alone).

The state machines are the tables of :mod:`tqtx.states`; every move goes through
:func:`tqtx.states.check`: repeating a transition into the state a row is already in is a
no-op (callers retry after lost replies), any other move it does not list raises
:class:`~tqtx.states.IllegalTransition`.
"""
from __future__ import annotations

import os
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.exc import DatabaseError

from .. import states as st
from ..paths import controller_journal_path, records_location
from ..states import IllegalTransition, check
from .base import _Journal, journal_writes, open_error, utcnow
from .meta import apply_change
from .migrate import CONTROLLER, DUMP, make_engine, open_plain
from .models import Dump, Incarnation, RecoveryEvent

# The reason the startup replay stores on the restores a previous incarnation left open.
RESTART_REASON = "controller restarted"


def _cols(obj, names) -> dict[str, Any]:
    return {n: getattr(obj, n) for n in names}


_INC_COLS = ("id", "started_at", "pid", "host", "address", "version", "state_dir", "ended_at")
_DUMP_COLS = ("dump_id", "dump_dir", "partition_id", "keys", "rows_with_data", "bytes", "shards",
              "incarnation_id", "created_at")
_EVENT_COLS = ("id", "incarnation_id", "at", "kind", "target", "action", "detail")
_RESTORE_COLS = ("restore_id", "partition_id", "dump_dir", "dump_id", "state", "outcome", "reason",
                 "keys", "rows", "bytes", "incarnation_id", "created_at", "updated_at",
                 "finished_at")
_UNIT_COLS = ("unit_id", "state", "rows", "bytes", "error")
_UNITS_SQL = f"SELECT restore_id, {', '.join(_UNIT_COLS)} FROM restore_units"
_PUB_COLS = ("attempt_id", "kind", "dump_id", "staging_dir", "phase", "error", "created_at",
             "updated_at")
_DRESTORE_COLS = ("restore_id", "controller_address", "incarnation_id", "controller_state_dir",
                  "partition_id", "state", "created_at", "updated_at")


# Plain SQL over a transaction's ``run`` (``exec_driver_sql``'s convention).
def _marks(values) -> str:
    """``?, ?, ...``: one parameter per value."""
    return ", ".join("?" * len(values))


def _select(run, table: str, cols: tuple, tail: str = "", params: tuple = ()) -> list[dict]:
    """Rows of ``table`` (``tail``: the SQL after ``FROM table``) as dicts of ``cols``."""
    rows = run(f"SELECT {', '.join(cols)} FROM {table} {tail}", params).fetchall()
    return [dict(zip(cols, r)) for r in rows]


def _insert(run, table: str, cols: tuple, row: dict) -> None:
    run(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({_marks(cols)})",
        tuple(row[c] for c in cols))


def _restores_newest_first(state, restore_id, limit) -> tuple[str, tuple]:
    """The tail and parameters of a newest-first listing of restores (either journal's),
    filtered by state and restore ID."""
    where = [(c, v) for c, v in (("state", state), ("restore_id", restore_id)) if v is not None]
    tail = (f"{'WHERE ' if where else ''}{' AND '.join(f'{c} = ?' for c, _ in where)} "
            "ORDER BY created_at DESC, restore_id LIMIT ?")
    return tail, (*(v for _, v in where), -1 if limit is None else limit)


# --------------------------------------------------------------------------- controller


class ControllerJournal(_Journal):
    """The controller's journal of incarnations, restores (with unit claims) and dumps."""

    _chain = CONTROLLER
    _wal = True

    def __init__(self, state_dir: str | os.PathLike, *, migrate: bool = True,
                 readonly: bool = False):
        """``readonly``: read an existing journal without waiting for its writer (never
        creates, migrates or writes it; ``tqtx journal show``)."""
        self.state_dir = Path(state_dir)
        if not readonly:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        self._open(controller_journal_path(self.state_dir), migrate, readonly)

    # incarnations -------------------------------------------------------------------

    def start_incarnation(self, *, pid: int, host: str, address: str, version: str) -> int:
        """Record a controller start; returns the new incarnation id."""
        with self._tx() as s:
            inc = Incarnation(started_at=utcnow(), pid=pid, host=host, address=address,
                              version=version, state_dir=str(self.state_dir))
            s.add(inc)
            s.flush()
            return inc.id

    def end_incarnation(self, inc_id: int) -> None:
        """Stamp a clean controller shutdown (idempotent)."""
        with self._tx() as s:
            inc = s.get(Incarnation, inc_id)
            if inc is None:
                raise KeyError(f"unknown incarnation {inc_id}")
            if inc.ended_at is None:
                inc.ended_at = utcnow()

    def list_incarnations(self, limit: int | None = None) -> list[dict]:
        """Incarnations, newest first."""
        with self._tx() as s:
            q = select(Incarnation).order_by(Incarnation.id.desc()).limit(limit)
            return [_cols(i, _INC_COLS) for i in s.scalars(q)]

    # restores -----------------------------------------------------------------------

    def _restore_dicts(self, run, where: str = "", params: tuple = ()) -> list[dict]:
        """Restores matching ``where`` (SQL after FROM restores), each with its claims."""
        out = _select(run, "restores", _RESTORE_COLS, where, params)
        units: dict[str, list[dict]] = {d["restore_id"]: [] for d in out}
        ids = list(units)
        for lo in range(0, len(ids), 500):  # SQLite bounds the parameters per statement
            chunk = tuple(ids[lo:lo + 500])
            for r in run(f"{_UNITS_SQL} WHERE restore_id IN ({_marks(chunk)}) "
                         "ORDER BY restore_id, unit_id", chunk).fetchall():
                units[r[0]].append(dict(zip(_UNIT_COLS, r[1:])))
        for d in out:
            d["units"] = units[d["restore_id"]]
        return out

    def _restore(self, run, restore_id: str, *, missing_ok: bool = False) -> dict | None:
        found = self._restore_dicts(run, "WHERE restore_id = ?", (restore_id,))
        if not found and not missing_ok:
            raise KeyError(f"unknown restore {restore_id!r}")
        return found[0] if found else None

    def begin_restore(self, *, restore_id: str, partition_id: str, dump_dir: str,
                      dump_id: str | None, incarnation_id: int, units: list[int], keys: int,
                      rows: int, bytes: int) -> dict:  # noqa: A002 - column name
        """Create an ``active`` restore with one ``pending`` claim per unit (idempotent)."""
        with self._sql() as run:
            found = self._restore(run, restore_id, missing_ok=True)
            if found is not None:
                return found
            now = utcnow()
            r = {"restore_id": restore_id, "partition_id": partition_id,
                 "dump_dir": os.fspath(dump_dir), "dump_id": dump_id, "state": st.ACTIVE,
                 "outcome": None, "reason": None, "keys": keys, "rows": rows, "bytes": bytes,
                 "incarnation_id": incarnation_id, "created_at": now, "updated_at": now,
                 "finished_at": None}
            _insert(run, "restores", _RESTORE_COLS, r)
            claims = [(restore_id, int(u), st.PENDING, now, now) for u in sorted(set(units))]
            if claims:
                run("INSERT INTO restore_units (restore_id, unit_id, state, rows, bytes, "
                    "created_at, updated_at) VALUES (?, ?, ?, 0, 0, ?, ?)", claims)
            r["units"] = [{"unit_id": c[1], "state": st.PENDING, "rows": 0, "bytes": 0,
                           "error": None} for c in claims]
            return r

    def _unit_move(self, restore_id: str, unit_id: int, to: str, *, check_first: bool = False,
                   **fields) -> dict:
        restore_states = st.UNIT_NEEDS_RESTORE.get(to)
        with self._sql() as run:
            # one statement: the restore's state and the claim (NULLs: no such claim)
            row = run(f"SELECT r.state, {', '.join('u.' + c for c in _UNIT_COLS)} FROM restores r "
                      "LEFT JOIN restore_units u ON u.restore_id = r.restore_id AND u.unit_id = ? "
                      "WHERE r.restore_id = ?", (unit_id, restore_id)).fetchone()
            if row is None:
                raise KeyError(f"unknown restore {restore_id!r}")
            rstate, u = row[0], dict(zip(_UNIT_COLS, row[1:]))
            if u["unit_id"] is None:
                raise KeyError(f"restore {restore_id!r} has no claim for unit {unit_id}")

            def _check_restore():
                if restore_states is not None and rstate not in restore_states:
                    raise IllegalTransition(
                        f"restore {restore_id!r} unit {unit_id}: cannot move {u['state']} -> "
                        f"{to} while the restore is {rstate} (needs {'/'.join(restore_states)})")

            if check_first:
                _check_restore()
            if not check(st.UNIT, u["state"], to, subject=f"restore {restore_id!r} unit {unit_id}"):
                return u
            _check_restore()
            u["state"] = to
            u.update(fields)
            sets = ", ".join(f"{k} = ?" for k in ("state", "updated_at", *fields))
            run(f"UPDATE restore_units SET {sets} WHERE restore_id = ? AND unit_id = ?",
                (to, utcnow(), *fields.values(), restore_id, unit_id))
            return u

    def claim_unit(self, restore_id: str, unit_id: int) -> dict:
        """pending -> claimed; the restore must be ``active``. Re-claiming is a no-op."""
        return self._unit_move(restore_id, unit_id, st.CLAIMED, check_first=True)

    def stage_unit(self, restore_id: str, unit_id: int, *, rows: int, bytes: int) -> dict:  # noqa: A002
        """claimed -> staged, recording what the unit staged; the restore must be ``active``."""
        return self._unit_move(restore_id, unit_id, st.STAGED, rows=rows, bytes=bytes)

    def apply_unit(self, restore_id: str, unit_id: int) -> dict:
        """staged -> applied; the restore must be ``committing`` (or ``committed``)."""
        return self._unit_move(restore_id, unit_id, st.APPLIED)

    def fail_unit(self, restore_id: str, unit_id: int, error: str) -> dict:
        """pending|claimed|staged -> failed, with the error text."""
        return self._unit_move(restore_id, unit_id, st.FAILED, error=error)

    def drop_unit(self, restore_id: str, unit_id: int) -> dict:
        """pending|claimed|staged -> dropped."""
        return self._unit_move(restore_id, unit_id, st.DROPPED)

    def decide_commit(self, restore_id: str, plan: bytes | None = None) -> dict:
        """active -> committing; the commit rule (:func:`tqtx.states.restore_decision`) must
        say commit: every claim is ``staged``. Repeating is a no-op. ``plan`` (the encoded
        restore plan) is stored with the decision, so a restarted controller can roll the
        restore forward."""
        with self._sql() as run:
            r = self._restore(run, restore_id)
            if check(st.RESTORE, r["state"], st.COMMITTING, subject=f"restore {restore_id!r}"):
                units = r["units"]
                if st.restore_decision(u["state"] for u in units) != st.COMMIT:
                    detail = ", ".join(f"unit {u['unit_id']}: {u['state']}" for u in units
                                       if u["state"] != st.STAGED)
                    raise IllegalTransition(
                        f"restore {restore_id!r}: illegal transition {r['state']} -> committing "
                        f"(not every claim is staged: {detail})")
                r["state"], r["updated_at"] = st.COMMITTING, utcnow()
                run("UPDATE restores SET state = ?, plan = ?, updated_at = ? WHERE restore_id = ?",
                    (r["state"], plan, r["updated_at"], restore_id))
            return r

    def restore_plan(self, restore_id: str) -> bytes | None:
        """The plan stored with a restore's commit decision (None once it ended)."""
        with self._sql() as run:
            row = run("SELECT plan FROM restores WHERE restore_id = ?", (restore_id,)).fetchone()
        return None if row is None else row[0]

    def note_reason(self, restore_id: str, reason: str | None) -> dict:
        """Record why a restore that is not final yet is still unresolved (no state change),
        e.g. ``redo_failed: <dump>: ...`` on a ``committing`` restore; final ones are kept."""
        with self._sql() as run:
            r = self._restore(run, restore_id)
            if r["state"] not in st.RESTORE_FINAL and r["reason"] != reason:
                r["reason"], r["updated_at"] = reason, utcnow()
                run("UPDATE restores SET reason = ?, updated_at = ? WHERE restore_id = ?",
                    (reason, r["updated_at"], restore_id))
            return r

    def finish_restore(self, restore_id: str, outcome: str, reason: str | None = None, *,
                       restart: bool = False, meta_change=None) -> dict:
        """Move a restore to a final state (outcome = that state).

        Same final outcome again is a no-op; a different one raises IllegalTransition.
        ``committing -> aborted`` is only legal with ``restart=True`` (see
        :meth:`abort_after_restart`). For any outcome but ``committed`` the restore's non-final
        claims become ``dropped``. ``meta_change`` (a :class:`~tqtx.journal.meta.MetaChange`,
        the published metadata of a commit) is written in the same transaction.
        """
        if outcome not in st.RESTORE_FINAL:
            raise IllegalTransition(f"restore {restore_id!r}: {outcome!r} is not a final state")
        with journal_writes(self.path), self._engine.begin() as conn:
            run = conn.exec_driver_sql
            r = self._restore(run, restore_id)
            if not check(st.RESTORE, r["state"], outcome, subject=f"restore {restore_id!r}",
                         restart=restart, detail=f" (reason {reason!r})" if reason else ""):
                return r
            now = utcnow()
            run("UPDATE restores SET state = ?, outcome = ?, reason = ?, plan = NULL, "
                "updated_at = ?, finished_at = ? WHERE restore_id = ?",
                (outcome, outcome, reason, now, now, restore_id))
            r.update(state=outcome, outcome=outcome, reason=reason, updated_at=now,
                     finished_at=now)
            if meta_change:
                # the raw cursor's executemany: a commit publishes every key of the restore
                apply_change(conn.connection.driver_connection.executemany, meta_change)
            if outcome != st.COMMITTED:
                final = tuple(st.UNIT_FINAL)
                run(f"UPDATE restore_units SET state = ?, updated_at = ? WHERE restore_id = ? "
                    f"AND state NOT IN ({_marks(final)})",
                    (st.DROPPED, now, restore_id, *final))
                for u in r["units"]:
                    if u["state"] not in final:
                        u["state"] = st.DROPPED
            return r

    def abort_after_restart(self, restore_id: str) -> dict:
        """End a restore a previous controller incarnation left open as ``aborted`` with reason
        :data:`RESTART_REASON` (the startup replay); legal even from ``committing``."""
        return self.finish_restore(restore_id, st.ABORTED, RESTART_REASON, restart=True)

    def get_restore(self, restore_id: str) -> dict | None:
        """The restore with its claims, or None."""
        with self._sql() as run:
            return self._restore(run, restore_id, missing_ok=True)

    def list_restores(self, *, state: str | None = None, restore_id: str | None = None,
                      limit: int | None = None) -> list[dict]:
        """Restores (newest first), optionally filtered by state or id."""
        tail, params = _restores_newest_first(state, restore_id, limit)
        with self._sql() as run:
            return self._restore_dicts(run, tail, params)

    def unresolved_restores(self) -> list[dict]:
        """Restores not in a final state, oldest first."""
        final = tuple(st.RESTORE_FINAL)
        with self._sql() as run:
            return self._restore_dicts(run, f"WHERE state NOT IN ({_marks(final)}) "
                                            "ORDER BY created_at, restore_id", final)

    # dumps / recovery -----------------------------------------------------------------

    def record_dump(self, *, dump_id: str, dump_dir: str, partition_id: str, keys: int,
                    rows_with_data: int, bytes: int, shards: int,  # noqa: A002
                    incarnation_id: int | None) -> dict:
        """Record a published dump (idempotent by dump_id: an existing row is kept)."""
        with self._sql() as run:  # plain SQL: every dump ends with this
            found = _select(run, "dumps", _DUMP_COLS, "WHERE dump_id = ?", (dump_id,))
            if found:
                return found[0]
            d = {"dump_id": dump_id, "dump_dir": os.fspath(dump_dir),
                 "partition_id": partition_id, "keys": keys, "rows_with_data": rows_with_data,
                 "bytes": bytes, "shards": shards, "incarnation_id": incarnation_id,
                 "created_at": utcnow()}
            _insert(run, "dumps", _DUMP_COLS, d)
            return d

    def list_dumps(self, limit: int | None = None) -> list[dict]:
        """Recorded dumps, newest first."""
        with self._tx() as s:
            q = select(Dump).order_by(Dump.created_at.desc(), Dump.dump_id).limit(limit)
            return [_cols(d, _DUMP_COLS) for d in s.scalars(q)]

    def record_recovery(self, *, incarnation_id: int | None, kind: str, target: str,
                        action: str, detail: str = "") -> dict:
        """Journal one recovery action (kind 'restore', 'publication' or 'buffer': a dead
        deployment's metadata dropped at startup)."""
        if kind not in ("restore", "publication", "buffer"):
            raise ValueError(f"recovery kind must be 'restore', 'publication' or 'buffer', "
                             f"not {kind!r}")
        with self._tx() as s:
            e = RecoveryEvent(incarnation_id=incarnation_id, at=utcnow(), kind=kind,
                              target=os.fspath(target), action=action, detail=detail)
            s.add(e)
            s.flush()
            return _cols(e, _EVENT_COLS)

    def list_recovery_events(self, limit: int | None = None) -> list[dict]:
        """Recovery events, newest first."""
        with self._tx() as s:
            q = select(RecoveryEvent).order_by(RecoveryEvent.id.desc()).limit(limit)
            return [_cols(e, _EVENT_COLS) for e in s.scalars(q)]


# --------------------------------------------------------------------------- dump


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
        :func:`tqtx.paths.records_location` puts it (beside the dump, or in ``state_dir``
        for a dump on read-only storage). ``readonly``: an existing journal, read without
        waiting for a writer (never created, migrated or written)."""
        self.dump_dir = Path(os.path.abspath(os.fspath(dump_dir)))
        journal = Path(path) if path is not None else records_location(self.dump_dir,
                                                                        state_dir)[1]
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

    def close(self) -> None:
        """Close the connection (and the engine's pool, if one was made)."""
        if self._plain is not None:
            self._plain.close()
        if self._engine is not None:
            self._engine.dispose()

    # publications ---------------------------------------------------------------------

    def _publication_rows(self, run, where: str = "", params: tuple = ()) -> list[dict]:
        return _select(run, "publications", _PUB_COLS, where, params)

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
            _insert(run, "publications", _PUB_COLS, p)
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
                run, f"WHERE phase NOT IN ({_marks(final)}) "
                     "ORDER BY created_at, attempt_id", final)

    # restores -------------------------------------------------------------------------

    def _restore_row(self, run, restore_id: str) -> dict | None:
        found = _select(run, "restores", _DRESTORE_COLS, "WHERE restore_id = ?", (restore_id,))
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
                _insert(run, "restores", _DRESTORE_COLS, r)
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
        tail, params = _restores_newest_first(state, restore_id, limit)
        with self._sql() as run:  # plain SQL: every dump asks this (active_restores)
            return _select(run, "restores", _DRESTORE_COLS, tail, params)

    def active_restores(self) -> list[dict]:
        """Restores still ``reading``."""
        return list(reversed(self.list_restores(state=st.READING)))
