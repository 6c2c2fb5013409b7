"""The usage ledger's route_score, for `loraplex models calibrate`.

The score `model: "auto"` gave each request it routed, which `loraplex models calibrate` reads to set the
pool's thresholds for a traffic share.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.add_column(sa.Column("route_score", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_ledger") as batch:
        batch.drop_column("route_score")
