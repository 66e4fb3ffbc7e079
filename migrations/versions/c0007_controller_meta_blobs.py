"""controller journal: meta_blobs, binary values decided with the metadata

A decided ``load_checkpoint`` keeps its per-unit read plan here, written in the transaction
of its decision, so that a controller restarted while a unit has neither staged nor switched
to the checkpoint (the unit restarted too) can have that unit read its rows again.

Revision ID: c0007
Revises: c0006
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c0007"
down_revision = "c0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "meta_blobs",
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("value", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_meta_blobs")),
    )


def downgrade() -> None:
    op.drop_table("meta_blobs")
