"""Tenants, API keys, base models and tenant adapters.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _created_at() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now())


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False, server_default="standard"),
        sa.Column("status", sa.String(16), nullable=False, server_default="active"),
        _created_at(),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
        sa.CheckConstraint("status IN ('active', 'disabled')", name="ck_tenants_status"),
    )
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("source", sa.String(1000), nullable=False),
        _created_at(),
        sa.PrimaryKeyConstraint("id", name="pk_models"),
        sa.UniqueConstraint("name", name="uq_models_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("name", sa.String(64), nullable=True),
        _created_at(),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("allowed_models", sa.JSON(), nullable=True),
        sa.Column("allowed_adapters", sa.JSON(), nullable=True),
        sa.Column("max_priority", sa.String(16), nullable=False, server_default="standard"),
        sa.Column("rpm_limit", sa.Integer(), nullable=True),
        sa.Column("tpm_limit", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants",
                                ondelete="CASCADE"),
        sa.UniqueConstraint("prefix", name="uq_api_keys_prefix"),
        sa.UniqueConstraint("secret_hash", name="uq_api_keys_secret_hash"),
        sa.CheckConstraint("max_priority IN ('realtime', 'standard', 'batch')", name="ck_api_keys_max_priority"),
        sa.CheckConstraint("rpm_limit IS NULL OR rpm_limit > 0", name="ck_api_keys_rpm_limit"),
        sa.CheckConstraint("tpm_limit IS NULL OR tpm_limit > 0", name="ck_api_keys_tpm_limit"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("base_model_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(4096), nullable=False),
        _created_at(),
        sa.PrimaryKeyConstraint("id", name="pk_adapters"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_adapters_tenant_id_tenants",
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["base_model_id"], ["models.id"], name="fk_adapters_base_model_id_models",
                                ondelete="RESTRICT"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),
    )
    op.create_index("ix_adapters_tenant_id", "adapters", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_adapters_tenant_id", table_name="adapters")
    op.drop_table("adapters")
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("models")
    op.drop_table("tenants")
