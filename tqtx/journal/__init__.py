"""The journals: SQLite files with forward-only state machines.

* :class:`~tqtx.journal.controller.ControllerJournal` -- ``<state_dir>/journal.sqlite`` (WAL),
  alembic chain ``controller``; the buffer's metadata in the same file is
  :class:`~tqtx.journal.meta.MetaJournal`'s.
* :class:`~tqtx.journal.dump.DumpJournal` -- ``<dump_dir>.journal.sqlite`` (rollback journal,
  works on network filesystems), alembic chain ``dump``.

:mod:`tqtx.journal.base` holds what both share, :mod:`tqtx.journal.migrate` the opening of a
file (pragmas, read-only connections) and its migrations, :mod:`tqtx.journal.models` the
schema.

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
