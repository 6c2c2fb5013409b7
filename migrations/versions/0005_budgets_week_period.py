"""Weekly budgets: the budgets table's period CHECK admits 'week' (ISO weeks, UTC, from Monday).

Downgrading deletes the weekly budgets first (the old CHECK refuses them); usage is untouched.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Frozen here, not read from billing/periods.py: a migration must mean the same thing forever.
_BEFORE = ("day", "month", "total")
_AFTER = ("day", "week", "month", "total")


def _period_check(periods: tuple[str, ...]) -> None:
    with op.batch_alter_table("budgets") as batch:
        batch.drop_constraint("ck_budgets_period", type_="check")
        batch.create_check_constraint("ck_budgets_period", f"period IN ({', '.join(repr(p) for p in periods)})")


def upgrade() -> None:
    _period_check(_AFTER)


def downgrade() -> None:
    op.execute(sa.text("DELETE FROM budgets WHERE period NOT IN ('day', 'month', 'total')"))
    _period_check(_BEFORE)
