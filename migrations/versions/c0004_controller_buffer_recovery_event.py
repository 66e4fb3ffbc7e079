"""controller journal: recovery events of kind 'buffer' (a dead deployment's metadata dropped)

Revision ID: c0004
Revises: c0003
Create Date: 2027-01-10
"""
from __future__ import annotations

from alembic import op

revision = "c0004"
down_revision = "c0003"
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
