"""controller journal: recovery events of kind 'buffer' (a dead deployment's metadata dropped)

Revision ID: c0005
Revises: c0004
Create Date: 2026-12-04
"""
from __future__ import annotations

from alembic import op

revision = "c0005"
down_revision = "c0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("recovery_events") as batch:
        batch.drop_constraint("kind", type_="check")
        batch.create_check_constraint(op.f("ck_recovery_events_kind"),
                                      "kind IN ('restore', 'publication', 'buffer')")


def downgrade() -> None:
    op.execute("DELETE FROM recovery_events WHERE kind = 'buffer'")
    with op.batch_alter_table("recovery_events") as batch:
        batch.drop_constraint("kind", type_="check")
        batch.create_check_constraint(op.f("ck_recovery_events_kind"),
                                      "kind IN ('restore', 'publication')")
