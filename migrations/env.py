"""Alembic environment for the two tqtx journals.

Both chains live in ``versions/`` and are told apart by alembic branch labels:
``controller`` (revisions ``c0001``, ``c0002``, ...) for ``<state_dir>/journal.sqlite`` and
``dump`` (``d0001``, ``d0002``, ...) for ``<dump_dir>.journal.sqlite``. A database only ever
holds one chain, so upgrade with ``controller@head`` or ``dump@head`` -- never ``heads``.

tqtx runs migrations programmatically (``tqtx.journal.migrate.upgrade_engine``), passing an open
connection in ``config.attributes["connection"]`` and the chain name in
``config.attributes["chain"]``. From the alembic command line pass ``-x journal=controller``
(or ``dump``) and ``-x url=sqlite:///path``.
"""
from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from tqtx.journal.models import ControllerBase, DumpBase

config = context.config
_x = context.get_x_argument(as_dictionary=True)
_chain = config.attributes.get("chain") or _x.get("journal")
target_metadata = {"controller": ControllerBase.metadata, "dump": DumpBase.metadata}.get(_chain)


def _url() -> str:
    return _x.get("url") or config.get_main_option("sqlalchemy.url")


def _configure(**kw) -> None:
    context.configure(target_metadata=target_metadata, render_as_batch=True, **kw)


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        # The caller's connection is already inside a BEGIN IMMEDIATE transaction; alembic
        # joins it, so the whole upgrade commits or rolls back as one unit.
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url())
    try:
        with engine.begin() as conn:
            _configure(connection=conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
