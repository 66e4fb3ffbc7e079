"""SQLAlchemy ORM models for the two tqtx journals.

Two independent metadata objects:

* :class:`ControllerBase` -- the controller journal ``<state_dir>/journal.sqlite``
  (alembic branch ``controller``).
* :class:`DumpBase` -- the per-dump journal ``<dump_dir>.journal.sqlite``
  (alembic branch ``dump``).

The models describe the schema at the head revision of each chain; the migrations in
``migrations/versions`` must produce exactly this schema (a test compares them).
Timestamps are UTC ISO-8601 strings with microseconds (sortable as text).
"""
from __future__ import annotations

from typing import Optional

from sqlalchemy import (
    BigInteger, CheckConstraint, ForeignKey, Index, Integer, LargeBinary, MetaData, String, Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ..states import DUMP_RESTORE_STATES, PUBLICATION_PHASES, RESTORE_STATES, UNIT_STATES

_NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


# --------------------------------------------------------------------------- controller


class ControllerBase(DeclarativeBase):
    metadata = MetaData(naming_convention=_NAMING)


class Incarnation(ControllerBase):
    __tablename__ = "incarnations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    started_at: Mapped[str] = mapped_column(String(40))
    pid: Mapped[int] = mapped_column(Integer)
    host: Mapped[str] = mapped_column(String(255))
    address: Mapped[str] = mapped_column(String(255))
    version: Mapped[str] = mapped_column(String(64))
    state_dir: Mapped[str] = mapped_column(Text)
    ended_at: Mapped[Optional[str]] = mapped_column(String(40), nullable=True)


class Restore(ControllerBase):
    __tablename__ = "restores"
    __table_args__ = (
        CheckConstraint(_in("state", RESTORE_STATES), name="state"),
        Index("ix_restores_state", "state"),
    )

    restore_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    partition_id: Mapped[str] = mapped_column(String(255))
    dump_dir: Mapped[str] = mapped_column(Text)
    dump_id: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    incarnation_id: Mapped[int] = mapped_column(ForeignKey("incarnations.id"))
    state: Mapped[str] = mapped_column(String(16))
    outcome: Mapped[Optional[str]] = mapped_column(String(16), nullable=True)
    reason: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    keys: Mapped[int] = mapped_column(Integer, server_default="0")
    rows: Mapped[int] = mapped_column(Integer, server_default="0")
    bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")
    created_at: Mapped[str] = mapped_column(String(40))
    updated_at: Mapped[str] = mapped_column(String(40))
    finished_at: Mapped[Optional[str]] = mapped_column(String(40), nullable=True)
    # msgpack of the decided plan (rows, indexes, schemas), written with the commit decision
    # so a restarted controller can roll the restore forward; cleared when it ends.
    plan: Mapped[Optional[bytes]] = mapped_column(LargeBinary, nullable=True)


class RestoreUnit(ControllerBase):
    __tablename__ = "restore_units"
    __table_args__ = (
        # At most one claim row per (restore, unit): a unit can never hold two live claims.
        UniqueConstraint("restore_id", "unit_id"),
        CheckConstraint(_in("state", UNIT_STATES), name="state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    restore_id: Mapped[str] = mapped_column(ForeignKey("restores.restore_id"))
    unit_id: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    rows: Mapped[int] = mapped_column(Integer, server_default="0")
    bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")
    error: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    created_at: Mapped[str] = mapped_column(String(40))
    updated_at: Mapped[str] = mapped_column(String(40))


class Dump(ControllerBase):
    __tablename__ = "dumps"

    dump_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    dump_dir: Mapped[str] = mapped_column(Text)
    partition_id: Mapped[str] = mapped_column(String(255))
    keys: Mapped[int] = mapped_column(Integer, server_default="0")
    rows_with_data: Mapped[int] = mapped_column(Integer, server_default="0")
    bytes: Mapped[int] = mapped_column(BigInteger, server_default="0")
    shards: Mapped[int] = mapped_column(Integer, server_default="0")
    incarnation_id: Mapped[Optional[int]] = mapped_column(ForeignKey("incarnations.id"),
                                                          nullable=True)
    created_at: Mapped[str] = mapped_column(String(40))


class RecoveryEvent(ControllerBase):
    __tablename__ = "recovery_events"
    __table_args__ = (CheckConstraint("kind IN ('restore', 'publication', 'buffer')",
                                      name="kind"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    incarnation_id: Mapped[Optional[int]] = mapped_column(ForeignKey("incarnations.id"),
                                                          nullable=True)
    at: Mapped[str] = mapped_column(String(40))
    kind: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text, server_default="")


# --------------------------------------------------------------------------- dump


class DumpBase(DeclarativeBase):
    metadata = MetaData(naming_convention=_NAMING)


class Publication(DumpBase):
    __tablename__ = "publications"
    __table_args__ = (
        CheckConstraint(_in("phase", PUBLICATION_PHASES), name="phase"),
        CheckConstraint("kind IN ('dump', 'checkpoint')", name="kind"),
        Index("ix_publications_phase", "phase"),
    )

    attempt_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    dump_id: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    staging_dir: Mapped[str] = mapped_column(Text)
    phase: Mapped[str] = mapped_column(String(16))
    error: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    created_at: Mapped[str] = mapped_column(String(40))
    updated_at: Mapped[str] = mapped_column(String(40))


class DumpRestore(DumpBase):
    __tablename__ = "restores"
    __table_args__ = (CheckConstraint(_in("state", DUMP_RESTORE_STATES), name="state"),)

    restore_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    controller_address: Mapped[str] = mapped_column(String(255))
    incarnation_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    controller_state_dir: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    partition_id: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[str] = mapped_column(String(40))
    updated_at: Mapped[str] = mapped_column(String(40))


# --------------------------------------------------------------------------- buffer metadata
# The controller's metadata, written through (see tqtx/journal/meta.py): one row per visible
# key, one per (partition, field) schema, and the next fresh global index. Rows of cleared
# keys are deleted, so the tables stay proportional to the live keys.


class MetaKey(ControllerBase):
    __tablename__ = "meta_keys"
    # WITHOUT ROWID: the (partition, key) primary key is the table's own b-tree (one b-tree
    # less to update per row: 5k upserts 49 -> 32 ms)
    __table_args__ = (UniqueConstraint("global_index"), {"sqlite_with_rowid": False})

    partition_id: Mapped[str] = mapped_column(Text, primary_key=True)
    key: Mapped[str] = mapped_column(Text, primary_key=True)
    global_index: Mapped[int] = mapped_column(Integer)
    fields: Mapped[str] = mapped_column(Text, server_default="[]")   # JSON list of names
    tag: Mapped[bytes] = mapped_column(LargeBinary)                  # msgpack of the tag dict
    lost_unit: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)  # row lost there
    # the generation of the key's row (tqtx.controller.metadata); NULL in rows written
    # before c0004, which replay gives new generations
    gen: Mapped[Optional[int]] = mapped_column(BigInteger, nullable=True)


class MetaSchema(ControllerBase):
    __tablename__ = "meta_schemas"

    partition_id: Mapped[str] = mapped_column(Text, primary_key=True)
    field: Mapped[str] = mapped_column(Text, primary_key=True)
    schema: Mapped[str] = mapped_column(Text)                        # JSON


class MetaMarker(ControllerBase):
    __tablename__ = "meta_markers"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[str] = mapped_column(Text)  # e.g. checkpoint_load: the load being switched to


class MetaBlob(ControllerBase):
    """A binary value decided with the metadata (e.g. checkpoint_plan: the read plan of the
    load being switched to, per unit)."""
    __tablename__ = "meta_blobs"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[bytes] = mapped_column(LargeBinary)


class MetaRequest(ControllerBase):
    """The reply to a recent mutating metadata request (CLEAR, COMMIT_PUT), written in the transaction
    of its change, so a controller that replaced the one that acted answers a resent copy
    with it instead of acting twice. The newest ``tqtx.journal.meta.REQUESTS_KEPT`` stay."""
    __tablename__ = "meta_requests"

    # keyed by seq (the row ID): an answer appends to the table's last page, and the
    # answers are read whole, in seq order, when a controller starts
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    request_id: Mapped[str] = mapped_column(String(64))
    reply: Mapped[bytes] = mapped_column(LargeBinary)                # msgpack of the reply


class MetaCounter(ControllerBase):
    __tablename__ = "meta_counters"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)
