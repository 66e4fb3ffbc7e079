"""What both journals share: the base class (engine, transactions, the read-only opening,
close), the plain-SQL helpers their methods use and the timestamp. The journals themselves
are in :mod:`tqtx.journal.controller` and :mod:`tqtx.journal.dump`.

Every read and write of a journal's rows is plain SQL in one ``BEGIN IMMEDIATE``
transaction (:meth:`_Journal._sql`, whose ``run`` is ``exec_driver_sql``'s convention);
the ORM models of :mod:`tqtx.journal.models` only define the schema."""
from __future__ import annotations

import errno
import os
import sqlite3
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, DatabaseError

from ..errors import JournalWriteError
from .migrate import HEADS, _stamped_revision, current_revision, make_engine, upgrade_engine

# SQLite's primary result codes that mean the file system refused a write, as errnos.
_SQLITE_ERRNO = {13: errno.ENOSPC,   # SQLITE_FULL
                 10: errno.EIO,      # SQLITE_IOERR (every SQLITE_IOERR_* extended code)
                 8: errno.EROFS,     # SQLITE_READONLY
                 3: errno.EACCES,    # SQLITE_PERM
                 14: errno.ENOENT}   # SQLITE_CANTOPEN
# The same by message, for a driver error without sqlite_errorcode (Python < 3.11).
_SQLITE_TEXT = {"database or disk is full": errno.ENOSPC, "disk I/O error": errno.EIO,
                "attempt to write a readonly database": errno.EROFS,
                "unable to open database file": errno.ENOENT}


def journal_write_error(exc: BaseException, path) -> JournalWriteError | None:
    """``exc`` (a sqlite3 or SQLAlchemy error) as a JournalWriteError naming ``path`` when it
    says the file system failed the journal (full disk, I/O error, read-only ...), else
    None: a damaged file, a constraint or a busy lock are other errors."""
    orig = getattr(exc, "orig", exc)
    if not isinstance(orig, sqlite3.Error):
        return None
    code = getattr(orig, "sqlite_errorcode", None)
    number = _SQLITE_ERRNO.get(code & 0xFF) if isinstance(code, int) else None
    if number is None:
        number = next((n for text, n in _SQLITE_TEXT.items() if text in str(orig)), None)
    if number is None:
        return None
    return JournalWriteError(number, f"{os.strerror(number)} (writing the journal: "
                                     f"SQLite: {orig})", os.fspath(path))


def open_error(exc: BaseException, path, chain: str, damaged) -> Exception:
    """What failing to open the journal at ``path`` means: a full disk (JournalWriteError),
    another process holding its lock past the busy timeout (JournalBusyError), else a
    damaged file (``damaged(message)``)."""
    full = journal_write_error(exc, path)
    if full is not None:
        return full
    text = str(getattr(exc, "orig", None) or exc)
    if "locked" in text or "busy" in text:
        from ..errors import JournalBusyError
        return JournalBusyError(f"{path}: the {chain} journal stayed locked by another "
                                f"process ({text}): a live controller in a long write, or a "
                                f"stuck one; the file itself is not damaged")
    return damaged(_damage(path, chain, exc))


@contextmanager
def journal_writes(path) -> Iterator[None]:
    """Raise a failed write to the journal at ``path`` as a JournalWriteError (errno and
    path, an OSError); other errors pass unchanged."""
    try:
        yield
    except (sqlite3.Error, DBAPIError) as exc:
        err = journal_write_error(exc, path)
        if err is None:
            raise
        raise err from None


def utcnow() -> str:
    """Current UTC time as an ISO-8601 string with microseconds (the journals' timestamp)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


# --------------------------------------------------------------------------- plain SQL
# Over a transaction's ``run`` (``exec_driver_sql``'s convention).
def sql_marks(values) -> str:
    """``?, ?, ...``: one parameter per value."""
    return ", ".join("?" * len(values))


def select_rows(run, table: str, cols: tuple, tail: str = "", params: tuple = ()) -> list[dict]:
    """Rows of ``table`` (``tail``: the SQL after ``FROM table``) as dicts of ``cols``."""
    rows = run(f"SELECT {', '.join(cols)} FROM {table} {tail}", params).fetchall()
    return [dict(zip(cols, r)) for r in rows]


def insert_row(run, table: str, cols: tuple, row: dict) -> int:
    """Insert ``row``'s ``cols`` into ``table``; returns the new rowid."""
    return run(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({sql_marks(cols)})",
               tuple(row[c] for c in cols)).lastrowid


def restores_newest_first(state, restore_id, limit) -> tuple[str, tuple]:
    """The tail and parameters of a newest-first listing of restores (either journal's),
    filtered by state and restore ID."""
    where = [(c, v) for c, v in (("state", state), ("restore_id", restore_id)) if v is not None]
    tail = (f"{'WHERE ' if where else ''}{' AND '.join(f'{c} = ?' for c, _ in where)} "
            "ORDER BY created_at DESC, restore_id LIMIT ?")
    return tail, (*(v for _, v in where), -1 if limit is None else limit)


# --------------------------------------------------------------------------- base


def _damage(path, chain: str, exc: Exception) -> str:
    return (f"{path}: damaged {chain} journal ({getattr(exc, 'orig', None) or exc}); move it "
            f"aside to start a new one")


class _Journal:
    _chain = ""
    _wal = True

    def _open(self, path: Path, migrate: bool, readonly: bool = False) -> None:
        self.path = path
        self._engine = make_engine(path, wal=self._wal, readonly=readonly)
        if migrate and not readonly:
            try:
                upgrade_engine(self._engine, path, self._chain)
            except DatabaseError as exc:
                self._engine.dispose()
                raise open_error(exc, path, self._chain, self._damaged) from None

    @staticmethod
    def _damaged(message: str) -> Exception:
        return RuntimeError(message)

    @property
    def engine(self) -> Engine:
        return self._engine

    @contextmanager
    def _sql(self):
        """One BEGIN IMMEDIATE transaction in plain SQL; yields ``run(sql, params)`` (no ORM
        session or statement compilation: several times cheaper per call)."""
        with journal_writes(self.path), self._engine.begin() as conn:
            yield conn.exec_driver_sql

    @classmethod
    def for_reading(cls, *args, **kwargs):
        """The journal opened read-only (``cls(*args, readonly=True, **kwargs)``): a reader
        never waits for the writer's lock (a live controller mid-write). One at an older
        revision is opened for writing instead, which upgrades it first."""
        j = cls(*args, readonly=True, **kwargs)
        try:
            stamp = j.stamp()
        except (sqlite3.Error, DatabaseError) as exc:
            j.close()
            raise open_error(exc, j.path, j._chain, j._damaged) from None
        except BaseException:
            j.close()
            raise
        if stamp == HEADS[j._chain]:
            return j
        j.close()
        return cls(*args, **kwargs)

    def stamp(self) -> str | None:
        """The revision stamped in the file, read with plain SQL (None without one)."""
        with self.engine.connect() as conn:
            return _stamped_revision(conn)

    def revision(self) -> str | None:
        """Alembic revision of this journal file."""
        return current_revision(self.engine)

    def close(self) -> None:
        """Release the connection pool."""
        self._engine.dispose()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
