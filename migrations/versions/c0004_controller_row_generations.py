"""controller journal: meta_keys.gen, the generation of each key's row (the row fence)

Revision ID: c0004
Revises: c0003
Create Date: 2026-12-04
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c0004"
down_revision = "c0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("meta_keys") as batch:
        batch.add_column(sa.Column("gen", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("meta_keys") as batch:
        batch.drop_column("gen")
