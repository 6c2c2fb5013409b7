"""Models' auto_max_complexity, for `model: "auto"`.

Which base models `model: "auto"` may choose, and up to what request complexity.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("auto_max_complexity", sa.Float(), nullable=True))
        batch.create_check_constraint(
            "ck_models_auto_max_complexity",
            "auto_max_complexity IS NULL OR (auto_max_complexity >= 0 AND auto_max_complexity <= 1)")


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_constraint("ck_models_auto_max_complexity", type_="check")
        batch.drop_column("auto_max_complexity")
