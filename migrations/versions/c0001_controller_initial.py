"""controller journal: initial schema (incarnations, restores, restore_units, dumps)

Revision ID: c0001
Revises:
Create Date: 2025-01-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c0001"
down_revision = None
branch_labels = ("controller",)
depends_on = None

_RESTORE_STATES = "state IN ('active', 'committing', 'committed', 'aborted', 'cancelled', 'failed')"
_UNIT_STATES = "state IN ('pending', 'claimed', 'staged', 'applied', 'failed', 'dropped')"


def upgrade() -> None:
    op.create_table(
        "incarnations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.String(40), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("address", sa.String(255), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("state_dir", sa.Text(), nullable=False),
        sa.Column("ended_at", sa.String(40), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_incarnations")),
    )
    op.create_table(
        "restores",
        sa.Column("restore_id", sa.String(64), nullable=False),
        sa.Column("partition_id", sa.String(255), nullable=False),
        sa.Column("dump_dir", sa.Text(), nullable=False),
        sa.Column("dump_id", sa.String(64), nullable=True),
        sa.Column("incarnation_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("keys", sa.Integer(), server_default="0", nullable=False),
        sa.Column("rows", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("updated_at", sa.String(40), nullable=False),
        sa.Column("finished_at", sa.String(40), nullable=True),
        sa.CheckConstraint(_RESTORE_STATES, name=op.f("ck_restores_state")),
        sa.ForeignKeyConstraint(["incarnation_id"], ["incarnations.id"],
                                name=op.f("fk_restores_incarnation_id_incarnations")),
        sa.PrimaryKeyConstraint("restore_id", name=op.f("pk_restores")),
    )
    op.create_table(
        "restore_units",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("restore_id", sa.String(64), nullable=False),
        sa.Column("unit_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("rows", sa.Integer(), server_default="0", nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("updated_at", sa.String(40), nullable=False),
        sa.CheckConstraint(_UNIT_STATES, name=op.f("ck_restore_units_state")),
        sa.ForeignKeyConstraint(["restore_id"], ["restores.restore_id"],
                                name=op.f("fk_restore_units_restore_id_restores")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_restore_units")),
        sa.UniqueConstraint("restore_id", "unit_id",
                            name=op.f("uq_restore_units_restore_id_unit_id")),
    )
    op.create_table(
        "dumps",
        sa.Column("dump_id", sa.String(64), nullable=False),
        sa.Column("dump_dir", sa.Text(), nullable=False),
        sa.Column("partition_id", sa.String(255), nullable=False),
        sa.Column("keys", sa.Integer(), server_default="0", nullable=False),
        sa.Column("rows_with_data", sa.Integer(), server_default="0", nullable=False),
        sa.Column("bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("shards", sa.Integer(), server_default="0", nullable=False),
        sa.Column("incarnation_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.ForeignKeyConstraint(["incarnation_id"], ["incarnations.id"],
                                name=op.f("fk_dumps_incarnation_id_incarnations")),
        sa.PrimaryKeyConstraint("dump_id", name=op.f("pk_dumps")),
    )


def downgrade() -> None:
    op.drop_table("dumps")
    op.drop_table("restore_units")
    op.drop_table("restores")
    op.drop_table("incarnations")
