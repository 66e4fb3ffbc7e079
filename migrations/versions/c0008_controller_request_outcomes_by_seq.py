"""controller journal: meta_requests keyed by its sequence number

Every COMMIT_PUT and CLEAR writes one answer row. Keyed by the request ID (random) with a
second index on ``seq``, each insert touched a random page of the ID index as well as the
table and the ``seq`` index; keyed by ``seq`` (the row ID), an insert appends to one page
and the trim removes a range of it. The answers are only ever read whole, in ``seq``
order, when a controller starts, so nothing looks a request ID up in SQL.

Revision ID: c0008
Revises: c0007
Create Date: 2026-12-07
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c0008"
down_revision = "c0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "meta_requests_by_seq",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("reply", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_meta_requests")),
    )
    op.execute("INSERT INTO meta_requests_by_seq (seq, request_id, reply) "
               "SELECT seq, request_id, reply FROM meta_requests")
    op.drop_index(op.f("ix_meta_requests_seq"), table_name="meta_requests")
    op.drop_table("meta_requests")
    op.rename_table("meta_requests_by_seq", "meta_requests")


def downgrade() -> None:
    op.create_table(
        "meta_requests_by_id",
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("reply", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_meta_requests")),
    )
    # a request ID answered twice keeps its newest answer, as the unique key did before
    op.execute("INSERT OR REPLACE INTO meta_requests_by_id (request_id, seq, reply) "
               "SELECT request_id, seq, reply FROM meta_requests ORDER BY seq")
    op.drop_table("meta_requests")
    op.rename_table("meta_requests_by_id", "meta_requests")
    op.create_index(op.f("ix_meta_requests_seq"), "meta_requests", ["seq"])
