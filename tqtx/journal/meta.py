"""The buffer's metadata in the controller journal: written through, replayed at startup.

The controller keeps partitions, keys, global indexes, produced fields, tags and schemas in
memory and, before it replies to a request that changed them, writes the change here in one
transaction (tables ``meta_keys``, ``meta_schemas``, ``meta_counters``; see docs/journal.md).
A controller that starts on the same state dir replays them with :meth:`MetaJournal.load`.

The hot path talks to SQLite through the DB-API connection under the SQLAlchemy engine
(``executemany`` of prepared statements): an ORM unit of work costs ~20x more per row, and a
5k-row put must stay within a few percent of an unjournaled one. Alembic still owns the
schema (migrations ``c0003``, ``c0004``) and the ORM models describe it.
"""
from __future__ import annotations

import errno
import json
from contextlib import contextmanager
import sqlite3
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable

from sqlalchemy import Engine

from .. import durability as dur
from .. import faults
from ..wire import codec
from ..errors import JournalWriteError
from ..layout import fsutil
from .base import journal_writes

DURABILITY = dur.DURABILITY
# SQLite's synchronous level per durability setting. WAL + NORMAL: a commit survives the
# process (it is in the OS page cache), not a power loss.
# "buffer" commits as NORMAL and makes them durable at each cut (MetaJournal.cut).
# "sync" commits without an fsync too: its requests share one durable cut per controller loop
# turn (tqtx.controller.group_commit) before they are answered
_SYNCHRONOUS = {dur.CONTROLLER: "NORMAL", dur.BUFFER: "NORMAL", dur.SYNC: "NORMAL"}
# After a checkpoint SQLite truncates the WAL back to this size, so one large transaction
# (a checkpoint replace of many keys) does not leave a large file behind.
_WAL_SIZE_LIMIT = 16 << 20

_UPSERT_ON = (" ON CONFLICT (partition_id, key) DO UPDATE SET "
              "global_index = excluded.global_index, fields = excluded.fields, "
              "tag = excluded.tag, lost_unit = excluded.lost_unit, gen = excluded.gen")
_UPSERT_KEYS = ("INSERT INTO meta_keys (partition_id, key, global_index, fields, tag, lost_unit, "
                "gen) VALUES ")
_ROW_COLUMNS = 7
# Rows per multi-row upsert statement: 896 parameters, under SQLite's lowest limit (999).
# One statement per 128 rows is ~2x cheaper than executemany's one per row.
_UPSERT_ROWS = 128
_DELETE_KEY = "DELETE FROM meta_keys WHERE partition_id = ? AND key = ?"
_UPSERT_SCHEMA = ("INSERT INTO meta_schemas (partition_id, field, schema) VALUES (?, ?, ?) "
                  "ON CONFLICT (partition_id, field) DO UPDATE SET schema = excluded.schema")
_DROP_SCHEMAS = "DELETE FROM meta_schemas WHERE partition_id = ?"
_SET_COUNTER = ("INSERT INTO meta_counters (name, value) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET value = excluded.value")
_SET_MARKER = ("INSERT INTO meta_markers (name, value) VALUES (?, ?) "
               "ON CONFLICT (name) DO UPDATE SET value = excluded.value")
_NEXT_INDEX = "next_index"
CHECKPOINT_LOAD = "checkpoint_load"  # marker: a load_checkpoint decided, units switching
CHECKPOINT_GEN_BASE = "checkpoint_gen_base"  # marker: that load's rows' generation base
CHECKPOINT_PLAN = "checkpoint_plan"  # blob: that load's read plan per unit (msgpack)
# blob: the keys of the checkpoint load decided last, as ``packb([gen_base, metadata])``
# (the checkpoint's controller file), until they are written to meta_keys row by row
CHECKPOINT_KEYS = "checkpoint_keys"
_SET_BLOB = ("INSERT INTO meta_blobs (name, value) VALUES (?, ?) "
             "ON CONFLICT (name) DO UPDATE SET value = excluded.value")
ROW_LOG_UNITS = "row_log_units"  # marker: the units logged their rows; how many there were
# Replies of mutating requests kept in meta_requests: a resent copy comes within the
# client's reconnect timeout, so the newest few thousand are plenty.
REQUESTS_KEPT = 4096
_ANSWER = "INSERT INTO meta_requests (seq, request_id, reply) VALUES (?, ?, ?)"
_TRIM_ANSWERS = "DELETE FROM meta_requests WHERE seq <= ?"
_TRIM_EVERY = 64  # answers written between trims (the table holds up to REQUESTS_KEPT + 64)


def check_durability(value: str) -> str:
    """The durability setting ``value`` names (:func:`tqtx.durability.check`: an earlier
    value mapped to its replacement with a DeprecationWarning); ValueError otherwise."""
    return dur.check(value)


@dataclass
class MetaChange:
    """What one request changed; written in one transaction.

    ``rows``: ``(partition, key, global_index, fields, tag, lost_unit, gen)`` to insert or
    replace; ``deleted``: ``(partition, key)``; ``schemas``: ``(partition, field, schema)``;
    ``dropped``: partitions whose schemas go (the partition has no keys left);
    ``replace``: wipe every table first (a checkpoint load replaces all metadata);
    ``answered``: ``(request ID, msgpack of the reply)`` of the request that made the change,
    so a controller that replaces this one answers a resent copy instead of acting again.
    """

    rows: list = field(default_factory=list)
    deleted: list = field(default_factory=list)
    schemas: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    next_index: int | None = None
    replace: bool = False
    markers: dict = field(default_factory=dict)  # name -> value (None: remove)
    blobs: dict = field(default_factory=dict)    # name -> bytes (None: remove)
    answered: tuple[str, bytes] | None = None

    def changes_keys(self) -> bool:
        """Whether it writes keys, schemas or the next index (a replace aside)."""
        return bool(self.rows or self.deleted or self.schemas or self.dropped
                    or self.next_index is not None)

    def __bool__(self) -> bool:
        return bool(self.changes_keys() or self.replace or self.markers or self.blobs
                    or self.answered)


_EMPTY_TAG = codec.packb({})


def apply_change(executemany: Callable[[str, Iterable], object], change: MetaChange) -> None:
    """Run the statements of ``change`` through ``executemany(sql, params)`` (inside the
    caller's transaction: the controller's own one, or a restore's finish)."""
    if change.replace:
        for table in ("meta_keys", "meta_schemas", "meta_counters", "meta_blobs"):
            executemany(f"DELETE FROM {table}", [()])
        # the deployment's row log unit count outlives a replaced buffer
        executemany("DELETE FROM meta_markers WHERE name != ?", [(ROW_LOG_UNITS,)])
    if change.deleted:
        executemany(_DELETE_KEY, change.deleted)
    if change.dropped:
        executemany(_DROP_SCHEMAS, [(pid,) for pid in change.dropped])
    if change.rows:
        _upsert_rows(executemany, change.rows)
    if change.schemas:
        executemany(_UPSERT_SCHEMA, [(pid, f, json.dumps(s, sort_keys=True))
                                     for pid, f, s in change.schemas])
    if change.next_index is not None:
        executemany(_SET_COUNTER, [(_NEXT_INDEX, int(change.next_index))])
    for name, value in change.markers.items():
        if value is None:
            executemany("DELETE FROM meta_markers WHERE name = ?", [(name,)])
        else:
            executemany(_SET_MARKER, [(name, str(value))])
    for name, value in change.blobs.items():
        if value is None:
            executemany("DELETE FROM meta_blobs WHERE name = ?", [(name,)])
        else:
            executemany(_SET_BLOB, [(name, bytes(value))])


@lru_cache(maxsize=32)
def _upsert_sql(rows: int) -> str:
    return _UPSERT_KEYS + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * rows) + _UPSERT_ON


def _upsert_rows(executemany, rows: list) -> None:
    """Insert or replace ``rows`` of meta_keys, :data:`_UPSERT_ROWS` per statement."""
    # rows share a handful of field sets: encode each set once (5k rows: 33 -> 6 ms)
    encoded: dict[frozenset, str] = {}
    # and keys given equal tags share one tag dict (tqtx.controller.metadata): pack each
    # object once (the rows keep them alive, so their ids stay theirs)
    packed: dict[int, bytes] = {}
    pack = codec.packer()
    flat: list = []
    for pid, key, idx, fields, tag, lost, gen in rows:
        fs = frozenset(fields)
        text = encoded.get(fs)
        if text is None:
            text = encoded[fs] = json.dumps(sorted(fs))
        if tag:
            blob = packed.get(id(tag))
            if blob is None:
                blob = packed[id(tag)] = pack(tag)
        else:
            blob = _EMPTY_TAG
        flat += (pid, key, idx, text, blob, lost, gen)
    step = _UPSERT_ROWS * _ROW_COLUMNS
    for lo in range(0, len(flat), step):
        chunk = flat[lo:lo + step]
        executemany(_upsert_sql(len(chunk) // _ROW_COLUMNS), [chunk])


def buffer_summary(engine: Engine) -> list[dict]:
    """Per partition: journaled keys and lost rows (``journal show``); the keys of a
    checkpoint load not yet written row by row are counted from its blob."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT partition_id, count(*), count(lost_unit) FROM meta_keys "
            "GROUP BY partition_id ORDER BY partition_id").fetchall()
        blob = conn.exec_driver_sql("SELECT value FROM meta_blobs WHERE name = ?",
                                    (CHECKPOINT_KEYS,)).fetchone()
    if blob is not None:  # then meta_keys holds no other key (KVRequests.journal_meta)
        parts = codec.unpackb(codec.unpackb(blob[0])[1])["partitions"]
        rows = [(pid, len(data["rows"]), sum(len(r) > 4 and r[4] is not None
                                             for r in data["rows"]))
                for pid, data in sorted(parts.items()) if data["rows"]]
    return [{"partition_id": pid, "keys": keys, "lost_rows": lost} for pid, keys, lost in rows]


class MetaJournal:
    """Write-through store of the controller's metadata on the controller journal's engine.

    ``durability`` (:mod:`tqtx.durability`): ``"memory"`` (nothing is written; tables left
    by an earlier durable run are emptied at open, so they can never resurrect stale keys),
    ``"controller"`` (WAL, synchronous NORMAL: a commit survives the process, not a power
    loss), ``"buffer"`` (as ``"controller"``, plus a durable cut at most every
    ``flush_interval_s``: :meth:`cut`) or ``"sync"`` (commits as ``"controller"``; the
    requests of one controller loop turn share one cut before they are answered:
    :mod:`tqtx.controller.group_commit`).
    The values of earlier releases are mapped with a DeprecationWarning.
    """

    def __init__(self, engine: Engine, durability: str = dur.DEFAULT,
                 flush_interval_s: float = dur.FLUSH_INTERVAL_S):
        self.durability = durability = dur.check(durability)
        self.flush_interval_s = dur.check_interval(flush_interval_s)
        self.path = engine.url.database  # named by a failed write's JournalWriteError
        self._pooled = engine.raw_connection()
        self._db = self._pooled.dbapi_connection
        self.transactions = 0
        self.cuts = 0  # durable cuts made (durability "buffer")
        self._dirty = False  # something was committed since the last cut
        self._last_cut = time.monotonic()
        self._answers = 0  # seq of the last answer written to meta_requests
        if self.enabled:
            self._db.execute(f"PRAGMA synchronous={_SYNCHRONOUS[durability]}")
            self._db.execute(f"PRAGMA journal_size_limit={_WAL_SIZE_LIMIT}")
            row = self._db.execute("SELECT max(seq) FROM meta_requests").fetchone()
            self._answers = int(row[0] or 0)
        else:
            self._write(MetaChange(replace=True))
            self._forget_answers()

    @property
    def enabled(self) -> bool:
        return self.durability != dur.MEMORY

    @property
    def cuts_wanted(self) -> bool:
        """Whether this journal makes periodic durable cuts (durability ``"buffer"``)."""
        return self.durability == dur.BUFFER

    @property
    def group_commits(self) -> bool:
        """Whether requests wait for a shared durable cut (durability ``"sync"``)."""
        return self.durability == dur.SYNC

    @property
    def dirty(self) -> bool:
        """Something was committed since the last cut (durability buffer and sync)."""
        return self._dirty

    def write(self, change: MetaChange) -> None:
        """Commit ``change`` (one transaction) unless durability is memory or it is empty."""
        if self.enabled and change:
            self._write(change)
            self._dirty = True

    def make_durable(self) -> None:
        """With durability buffer or sync, a cut now (:meth:`cut`): for a decision that
        other processes act on before the request is answered (a checkpoint load's)."""
        if self.durability in dur.LOGGED:
            self.cut()

    def cut_due(self, now: float | None = None) -> bool:
        """Whether a cut is due: durability ``"buffer"``, something committed since the
        last cut, and ``flush_interval_s`` passed since it."""
        if not (self._dirty and self.cuts_wanted):
            return False
        now = time.monotonic() if now is None else now
        return now - self._last_cut >= self.flush_interval_s

    def cut(self) -> bool:
        """Make every transaction committed so far durable; False (nothing done) when none
        was committed since the last cut.

        An fsync of the WAL file: in WAL mode a commit under synchronous NORMAL is written
        to the WAL and not fsynced, and the database file changes only in checkpoints,
        which fsync the WAL before they copy it and the database file after
        (https://sqlite.org/pragma.html#pragma_synchronous). So the WAL holds every commit
        not yet in a durable database file, and one fsync of it does what a commit under
        synchronous FULL would, without a transaction.
        A PASSIVE checkpoint would not do: it syncs the WAL only when it can copy frames
        back, which a reader holding an old snapshot prevents. Called on the controller's
        loop thread, the only one using this connection."""
        if not self._dirty:
            return False
        self._last_cut = time.monotonic()  # a failed cut is tried again an interval later
        faults.hit("controller.meta.durable_cut.before_fsync")
        try:
            fsutil.fsync_file(self.path + "-wal")
        except OSError as exc:
            raise JournalWriteError(exc.errno or errno.EIO, f"{exc.strerror or exc} (making "
                                    f"the journal durable)", self.path) from None
        self.cuts += 1
        self._dirty = False
        return True

    def _write(self, change: MetaChange) -> None:
        """One transaction. A write the file system fails (a full disk) is a
        JournalWriteError naming the journal; the transaction is rolled back either way
        (SQLite may have done so itself), so the next write starts clean once the cause
        is gone."""
        db = self._db
        with journal_writes(self.path), self._transaction():
            apply_change(db.executemany, change)
            if change.answered is not None:
                self._write_answer(change.answered)
        self.transactions += 1

    @contextmanager
    def _transaction(self):
        """BEGIN IMMEDIATE ... COMMIT; on any error a ROLLBACK (if SQLite did not roll
        back itself), and the error raised."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the error that got us here is the one to report
            raise

    def _write_answer(self, answered: tuple[str, bytes]) -> None:
        """Record a request's reply (inside the change's transaction); every
        :data:`_TRIM_EVERY` answers, drop those beyond the newest :data:`REQUESTS_KEPT`."""
        seq = self._answers + 1
        self._db.execute(_ANSWER, (seq, answered[0], answered[1]))
        if seq % _TRIM_EVERY == 0:
            self._db.execute(_TRIM_ANSWERS, (seq - REQUESTS_KEPT,))
        self._answers = seq

    def _forget_answers(self) -> None:
        db = self._db
        with journal_writes(self.path):
            db.execute("DELETE FROM meta_requests")
            db.commit()

    def load(self) -> dict:
        """The stored metadata: ``{"next_index", "partitions": {pid: {"schema": {field:
        schema}, "rows": [[key, global_index, fields, tag, lost_unit, gen], ...]}},
        "markers", "blobs", "answered"}`` (``gen`` None in rows written before migration c0004;
        ``answered``: ``[(request ID, msgpack of the reply)]``, oldest first)."""
        parts: dict[str, dict] = {}
        if not self.enabled:
            return {"next_index": 0, "partitions": parts, "markers": {}, "blobs": {},
                    "answered": []}
        db, loads, unpackb = self._db, json.loads, codec.unpackb
        field_sets: dict[str, list] = {}  # rows share a handful of field lists: decode once
        # and of tags: rows with equal tags share one dict (the metadata replaces a key's
        # tag dict, never changes one in place)
        tags: dict[bytes, dict] = {}
        last_pid = last_fields = last_tag = None  # rows of one put come in a row
        for pid, key, idx, fields, tag, lost, gen in db.execute(
                "SELECT partition_id, key, global_index, fields, tag, lost_unit, gen "
                "FROM meta_keys ORDER BY partition_id, global_index"):
            if pid != last_pid:
                part = parts.get(pid)
                if part is None:
                    part = parts[pid] = {"schema": {}, "rows": []}
                append, last_pid = part["rows"].append, pid
            if fields != last_fields:
                names = field_sets.get(fields)
                if names is None:
                    names = field_sets[fields] = loads(fields)
                last_fields = fields
            if tag != last_tag:
                value = tags.get(tag)
                if value is None:
                    value = tags[tag] = unpackb(tag)
                last_tag = tag
            append([key, idx, names, value, lost, gen])
        for pid, name, schema in db.execute(
                "SELECT partition_id, field, schema FROM meta_schemas"):
            if pid in parts:
                parts[pid]["schema"][name] = loads(schema)
        row = db.execute("SELECT value FROM meta_counters WHERE name = ?",
                         (_NEXT_INDEX,)).fetchone()
        markers = dict(db.execute("SELECT name, value FROM meta_markers"))
        blobs = dict(db.execute("SELECT name, value FROM meta_blobs"))
        answered = db.execute("SELECT request_id, reply FROM meta_requests ORDER BY seq").fetchall()
        return {"next_index": int(row[0]) if row else 0, "partitions": parts,
                "markers": markers, "blobs": blobs, "answered": answered}

    def close(self) -> None:
        self._pooled.close()
