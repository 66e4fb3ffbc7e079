"""The controller journal, ``<state_dir>/journal.sqlite`` (WAL, alembic chain
``controller``): incarnations, restores with their unit claims, dumps and recovery events.
The buffer's metadata in the same file is :mod:`tqtx.journal.meta`'s."""
from __future__ import annotations

import os
from pathlib import Path

from .. import states as st
from ..layout.paths import controller_journal_path
from ..states import IllegalTransition, check
from .base import (_Journal, insert_row, journal_writes, restores_newest_first, select_rows,
                   sql_marks, utcnow)
from .meta import apply_change
from .migrate import CONTROLLER

# The reason the startup replay stores on the restores a previous incarnation left open.
RESTART_REASON = "controller restarted"

_INC_COLS = ("id", "started_at", "pid", "host", "address", "version", "state_dir", "ended_at")
_DUMP_COLS = ("dump_id", "dump_dir", "partition_id", "keys", "rows_with_data", "bytes", "shards",
              "incarnation_id", "created_at")
_EVENT_COLS = ("id", "incarnation_id", "at", "kind", "target", "action", "detail")
_RESTORE_COLS = ("restore_id", "partition_id", "dump_dir", "dump_id", "state", "outcome", "reason",
                 "keys", "rows", "bytes", "incarnation_id", "created_at", "updated_at",
                 "finished_at")
_UNIT_COLS = ("unit_id", "state", "rows", "bytes", "error")
_UNITS_SQL = f"SELECT restore_id, {', '.join(_UNIT_COLS)} FROM restore_units"


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
        with self._sql() as run:
            return run("INSERT INTO incarnations (started_at, pid, host, address, version, "
                       "state_dir) VALUES (?, ?, ?, ?, ?, ?)",
                       (utcnow(), pid, host, address, version, str(self.state_dir))).lastrowid

    def end_incarnation(self, inc_id: int) -> None:
        """Stamp a clean controller shutdown (idempotent)."""
        with self._sql() as run:
            found = run("SELECT ended_at FROM incarnations WHERE id = ?", (inc_id,)).fetchall()
            if not found:
                raise KeyError(f"unknown incarnation {inc_id}")
            if found[0][0] is None:
                run("UPDATE incarnations SET ended_at = ? WHERE id = ?", (utcnow(), inc_id))

    def list_incarnations(self, limit: int | None = None) -> list[dict]:
        """Incarnations, newest first."""
        with self._sql() as run:
            return select_rows(run, "incarnations", _INC_COLS, "ORDER BY id DESC LIMIT ?",
                               (-1 if limit is None else limit,))

    # restores -----------------------------------------------------------------------

    def _restore_dicts(self, run, where: str = "", params: tuple = ()) -> list[dict]:
        """Restores matching ``where`` (SQL after FROM restores), each with its claims."""
        out = select_rows(run, "restores", _RESTORE_COLS, where, params)
        units: dict[str, list[dict]] = {d["restore_id"]: [] for d in out}
        ids = list(units)
        for lo in range(0, len(ids), 500):  # SQLite bounds the parameters per statement
            chunk = tuple(ids[lo:lo + 500])
            for r in run(f"{_UNITS_SQL} WHERE restore_id IN ({sql_marks(chunk)}) "
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
            insert_row(run, "restores", _RESTORE_COLS, r)
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
                    f"AND state NOT IN ({sql_marks(final)})",
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
        tail, params = restores_newest_first(state, restore_id, limit)
        with self._sql() as run:
            return self._restore_dicts(run, tail, params)

    def unresolved_restores(self) -> list[dict]:
        """Restores not in a final state, oldest first."""
        final = tuple(st.RESTORE_FINAL)
        with self._sql() as run:
            return self._restore_dicts(run, f"WHERE state NOT IN ({sql_marks(final)}) "
                                            "ORDER BY created_at, restore_id", final)

    # dumps / recovery -----------------------------------------------------------------

    def record_dump(self, *, dump_id: str, dump_dir: str, partition_id: str, keys: int,
                    rows_with_data: int, bytes: int, shards: int,  # noqa: A002
                    incarnation_id: int | None) -> dict:
        """Record a published dump (idempotent by dump_id: an existing row is kept)."""
        with self._sql() as run:  # plain SQL: every dump ends with this
            found = select_rows(run, "dumps", _DUMP_COLS, "WHERE dump_id = ?", (dump_id,))
            if found:
                return found[0]
            d = {"dump_id": dump_id, "dump_dir": os.fspath(dump_dir),
                 "partition_id": partition_id, "keys": keys, "rows_with_data": rows_with_data,
                 "bytes": bytes, "shards": shards, "incarnation_id": incarnation_id,
                 "created_at": utcnow()}
            insert_row(run, "dumps", _DUMP_COLS, d)
            return d

    def list_dumps(self, limit: int | None = None) -> list[dict]:
        """Recorded dumps, newest first."""
        with self._sql() as run:
            return select_rows(run, "dumps", _DUMP_COLS,
                               "ORDER BY created_at DESC, dump_id LIMIT ?",
                               (-1 if limit is None else limit,))

    def record_recovery(self, *, incarnation_id: int | None, kind: str, target: str,
                        action: str, detail: str = "") -> dict:
        """Journal one recovery action (kind 'restore', 'publication' or 'buffer': a dead
        deployment's metadata dropped at startup)."""
        if kind not in ("restore", "publication", "buffer"):
            raise ValueError(f"recovery kind must be 'restore', 'publication' or 'buffer', "
                             f"not {kind!r}")
        e = {"incarnation_id": incarnation_id, "at": utcnow(), "kind": kind,
             "target": os.fspath(target), "action": action, "detail": detail}
        with self._sql() as run:
            e["id"] = insert_row(run, "recovery_events", _EVENT_COLS[1:], e)
        return {c: e[c] for c in _EVENT_COLS}

    def list_recovery_events(self, limit: int | None = None) -> list[dict]:
        """Recovery events, newest first."""
        with self._sql() as run:
            return select_rows(run, "recovery_events", _EVENT_COLS, "ORDER BY id DESC LIMIT ?",
                               (-1 if limit is None else limit,))
