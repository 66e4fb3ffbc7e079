"""controller journal: the buffer's metadata (meta_keys, meta_schemas, meta_counters, meta_markers), restores.plan

Revision ID: c0003
Revises: c0002
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c0003"
down_revision = "c0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("restores") as batch:
        batch.add_column(sa.Column("plan", sa.LargeBinary(), nullable=True))
    op.create_table(
        "meta_keys",
        sa.Column("partition_id", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("global_index", sa.Integer(), nullable=False),
        sa.Column("fields", sa.Text(), server_default="[]", nullable=False),
        sa.Column("tag", sa.LargeBinary(), nullable=False),
        sa.Column("lost_unit", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("partition_id", "key", name=op.f("pk_meta_keys")),
        sa.UniqueConstraint("global_index", name=op.f("uq_meta_keys_global_index")),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "meta_schemas",
        sa.Column("partition_id", sa.Text(), nullable=False),
        sa.Column("field", sa.Text(), nullable=False),
        sa.Column("schema", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("partition_id", "field", name=op.f("pk_meta_schemas")),
    )
    op.create_table(
        "meta_markers",
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_meta_markers")),
    )
    op.create_table(
        "meta_counters",
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_meta_counters")),
    )


def downgrade() -> None:
    op.drop_table("meta_counters")
    op.drop_table("meta_markers")
    op.drop_table("meta_schemas")
    op.drop_table("meta_keys")
    with op.batch_alter_table("restores") as batch:
        batch.drop_column("plan")
