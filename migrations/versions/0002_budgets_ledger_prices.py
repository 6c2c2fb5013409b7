"""Budgets, the usage ledger with daily rollups, prices, and tenants' default max_tokens.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# SQLite turns only a column typed exactly INTEGER PRIMARY KEY into an auto-incrementing rowid.
_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _id() -> sa.Column:
    return sa.Column("id", _ID, nullable=False, autoincrement=True)


def _stamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _counts(*names: str, kind=sa.BigInteger) -> list[sa.Column]:
    return [sa.Column(name, kind(), nullable=False) for name in names]


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("default_max_tokens", sa.Integer(), nullable=True))
        batch.create_check_constraint("ck_tenants_default_max_tokens",
                                      "default_max_tokens IS NULL OR default_max_tokens > 0")
    op.create_table(
        "budgets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("period", sa.String(8), nullable=False),
        sa.Column("limit_tokens", sa.BigInteger(), nullable=False),
        sa.Column("soft_limit_tokens", sa.BigInteger(), nullable=True),
        _stamp("created_at"),
        _stamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_budgets"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_budgets_tenant_id_tenants", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"], name="fk_budgets_key_id_api_keys", ondelete="CASCADE"),
        sa.CheckConstraint("period IN ('day', 'month', 'total')", name="ck_budgets_period"),
        sa.CheckConstraint("limit_tokens > 0", name="ck_budgets_limit_tokens"),
        sa.CheckConstraint("soft_limit_tokens IS NULL OR (soft_limit_tokens > 0 AND soft_limit_tokens <= limit_tokens)",
                           name="ck_budgets_soft_limit_tokens"),
    )
    op.create_index("uq_budgets_tenant_id_period", "budgets", ["tenant_id", "period"], unique=True,
                    postgresql_where=sa.text("key_id IS NULL"), sqlite_where=sa.text("key_id IS NULL"))
    op.create_index("uq_budgets_key_id_period", "budgets", ["key_id", "period"], unique=True,
                    postgresql_where=sa.text("key_id IS NOT NULL"), sqlite_where=sa.text("key_id IS NOT NULL"))
    op.create_table(
        "usage_ledger",
        _id(),
        sa.Column("request_id", sa.String(64), nullable=False),
        _stamp("created_at"),
        *_counts("tenant_id", "key_id", kind=sa.Integer),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("adapter", sa.String(64), nullable=True),
        sa.Column("priority", sa.String(16), nullable=False),
        sa.Column("routed_from", sa.String(200), nullable=True),
        sa.Column("endpoint", sa.String(32), nullable=False),
        *_counts("prompt_tokens", "cached_tokens", "completion_tokens", kind=sa.Integer),
        sa.Column("ttft_ms", sa.Integer(), nullable=True),
        sa.Column("latency_ms", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("price_id", sa.Integer(), nullable=True),
        sa.Column("currency", sa.String(3), nullable=True),
        sa.Column("cost_picos", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_usage_ledger"),
        sa.UniqueConstraint("request_id", name="uq_usage_ledger_request_id"),
        sa.CheckConstraint("prompt_tokens >= 0 AND cached_tokens >= 0 AND completion_tokens >= 0",
                           name="ck_usage_ledger_tokens"),
    )
    op.create_index("ix_usage_ledger_tenant_id_created_at", "usage_ledger", ["tenant_id", "created_at"])
    op.create_index("ix_usage_ledger_created_at", "usage_ledger", ["created_at"])
    op.create_table(
        "usage_daily",
        _id(),
        sa.Column("day", sa.Date(), nullable=False),
        *_counts("tenant_id", "key_id", kind=sa.Integer),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("adapter", sa.String(64), nullable=False),
        sa.Column("price_id", sa.Integer(), nullable=False),
        *_counts("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_picos"),
        sa.PrimaryKeyConstraint("id", name="pk_usage_daily"),
        sa.UniqueConstraint("day", "tenant_id", "key_id", "model", "adapter", "price_id", name="uq_usage_daily_grain"),
    )
    op.create_index("ix_usage_daily_tenant_id_day", "usage_daily", ["tenant_id", "day"])
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        *_counts("input_micros", "cached_input_micros", "output_micros"),
        _stamp("effective_from"),
        _stamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_prices"),
        sa.UniqueConstraint("model", "effective_from", name="uq_prices_model_effective_from"),
        sa.CheckConstraint("input_micros >= 0 AND cached_input_micros >= 0 AND output_micros >= 0",
                           name="ck_prices_non_negative"),
    )


def downgrade() -> None:
    op.drop_table("prices")
    op.drop_index("ix_usage_daily_tenant_id_day", table_name="usage_daily")
    op.drop_table("usage_daily")
    op.drop_index("ix_usage_ledger_created_at", table_name="usage_ledger")
    op.drop_index("ix_usage_ledger_tenant_id_created_at", table_name="usage_ledger")
    op.drop_table("usage_ledger")
    op.drop_index("uq_budgets_key_id_period", table_name="budgets")
    op.drop_index("uq_budgets_tenant_id_period", table_name="budgets")
    op.drop_table("budgets")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_constraint("ck_tenants_default_max_tokens", type_="check")
        batch.drop_column("default_max_tokens")
