"""controller journal: bytes columns, restores.state index, recovery_events table

Revision ID: c0002
Revises: c0001
Create Date: 2025-01-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c0002"
down_revision = "c0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("restores") as batch:
        batch.add_column(sa.Column("bytes", sa.BigInteger(), server_default="0", nullable=False))
        batch.create_index("ix_restores_state", ["state"])
    with op.batch_alter_table("restore_units") as batch:
        batch.add_column(sa.Column("bytes", sa.BigInteger(), server_default="0", nullable=False))
    op.create_table(
        "recovery_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("incarnation_id", sa.Integer(), nullable=True),
        sa.Column("at", sa.String(40), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("detail", sa.Text(), server_default="", nullable=False),
        sa.CheckConstraint("kind IN ('restore', 'publication')",
                           name=op.f("ck_recovery_events_kind")),
        sa.ForeignKeyConstraint(["incarnation_id"], ["incarnations.id"],
                                name=op.f("fk_recovery_events_incarnation_id_incarnations")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_recovery_events")),
    )


def downgrade() -> None:
    op.drop_table("recovery_events")
    with op.batch_alter_table("restore_units") as batch:
        batch.drop_column("bytes")
    with op.batch_alter_table("restores") as batch:
        batch.drop_index("ix_restores_state")
        batch.drop_column("bytes")
