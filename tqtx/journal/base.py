"""What both journals share: the base class (engine, transactions, close) and the
timestamp. The journals themselves are in :mod:`tqtx.journal.store`."""
from __future__ import annotations

from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from sqlalchemy import Engine
from sqlalchemy.exc import DatabaseError
from sqlalchemy.orm import Session

from .migrate import current_revision, make_engine, upgrade_engine


def utcnow() -> str:
    """Current UTC time as an ISO-8601 string with microseconds (the journals' timestamp)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


# --------------------------------------------------------------------------- base


def _damage(path, chain: str, exc: Exception) -> str:
    return (f"{path}: damaged {chain} journal ({getattr(exc, 'orig', None) or exc}); move it "
            f"aside to start a new one")


class _Journal:
    _chain = ""
    _wal = True

    def _open(self, path: Path, migrate: bool) -> None:
        self.path = path
        self._engine = make_engine(path, wal=self._wal)
        if migrate:
            try:
                upgrade_engine(self._engine, path, self._chain)
            except DatabaseError as exc:
                self._engine.dispose()
                raise self._damaged(_damage(path, self._chain, exc)) from None

    @staticmethod
    def _damaged(message: str) -> Exception:
        return RuntimeError(message)

    @property
    def engine(self) -> Engine:
        return self._engine

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with Session(self._engine, expire_on_commit=False) as s:
            with s.begin():
                yield s

    @contextmanager
    def _sql(self):
        """One BEGIN IMMEDIATE transaction in plain SQL (the dump path's calls: no ORM
        session or statement compilation, several times cheaper per call)."""
        with self._engine.begin() as conn:
            yield conn.exec_driver_sql

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
