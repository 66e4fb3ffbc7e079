"""dump journal: initial schema (publications, restores)

Revision ID: d0001
Revises:
Create Date: 2025-01-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "d0001"
down_revision = None
branch_labels = ("dump",)
depends_on = None

_PHASES = ("phase IN ('staging', 'written', 'synced', 'old-moved', 'published', 'cleaned', "
           "'failed', 'rolled-back')")
_STATES = "state IN ('reading', 'committed', 'aborted', 'cancelled', 'failed')"


def upgrade() -> None:
    op.create_table(
        "publications",
        sa.Column("attempt_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("dump_id", sa.String(64), nullable=True),
        sa.Column("staging_dir", sa.Text(), nullable=False),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("updated_at", sa.String(40), nullable=False),
        sa.CheckConstraint(_PHASES, name=op.f("ck_publications_phase")),
        sa.CheckConstraint("kind IN ('dump', 'checkpoint')", name=op.f("ck_publications_kind")),
        sa.PrimaryKeyConstraint("attempt_id", name=op.f("pk_publications")),
    )
    op.create_table(
        "restores",
        sa.Column("restore_id", sa.String(64), nullable=False),
        sa.Column("controller_address", sa.String(255), nullable=False),
        sa.Column("incarnation_id", sa.Integer(), nullable=True),
        sa.Column("partition_id", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("updated_at", sa.String(40), nullable=False),
        sa.CheckConstraint(_STATES, name=op.f("ck_restores_state")),
        sa.PrimaryKeyConstraint("restore_id", name=op.f("pk_restores")),
    )


def downgrade() -> None:
    op.drop_table("restores")
    op.drop_table("publications")
