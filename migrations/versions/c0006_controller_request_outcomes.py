"""controller journal: meta_requests, the outcome of each recent mutating metadata request

A request whose reply was lost with its controller is sent again, with the same request ID,
to the controller that replaced it; this table lets that one answer the recorded outcome
instead of applying the request a second time (a second CLEAR would remove a later put, a
second COMMIT_PUT undo a later put's tags).

Revision ID: c0006
Revises: c0005
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c0006"
down_revision = "c0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "meta_requests",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("reply", sa.LargeBinary(), nullable=False),
    )
    op.create_index(op.f("ix_meta_requests_seq"), "meta_requests", ["seq"])


def downgrade() -> None:
    op.drop_index(op.f("ix_meta_requests_seq"), table_name="meta_requests")
    op.drop_table("meta_requests")
