"""dump journal: publications.error, restores.controller_state_dir, phase index

Revision ID: d0002
Revises: d0001
Create Date: 2025-01-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "d0002"
down_revision = "d0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("publications") as batch:
        batch.add_column(sa.Column("error", sa.Text(), nullable=True))
        batch.create_index("ix_publications_phase", ["phase"])
    with op.batch_alter_table("restores") as batch:
        batch.add_column(sa.Column("controller_state_dir", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("restores") as batch:
        batch.drop_column("controller_state_dir")
    with op.batch_alter_table("publications") as batch:
        batch.drop_index("ix_publications_phase")
        batch.drop_column("error")
