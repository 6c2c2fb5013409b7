"""The billing tables: the usage ledger, its daily rollups and the price list.

They live in their own MetaData because billing may not import the platform; the platform adds
this MetaData to its own for Alembic (migrations/versions/0002 makes them). The ledger has no
foreign keys on purpose: it is a financial record, written from a spool hours later if need be,
and nothing that happens to a tenant or key may block or cascade into it.

Money is stored as integers (see money.py): prices in micro-units per 1M tokens, costs in
pico-units. `usage_daily` is keyed by (day, tenant, key, model, adapter, price) with '' for no
adapter and 0 for no price, so that its unique key has no NULLs and upserts can add to it.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Date,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    UniqueConstraint,
)

metadata = MetaData()

# SQLite makes an auto-incrementing rowid only for a column typed exactly INTEGER PRIMARY KEY.
Id = BigInteger().with_variant(Integer(), "sqlite")

usage_ledger = Table(
    "usage_ledger", metadata,
    Column("id", Id, nullable=False, autoincrement=True),
    Column("request_id", String(64), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),  # the request's arrival
    Column("tenant_id", Integer, nullable=False),
    Column("key_id", Integer, nullable=False),
    Column("model", String(200), nullable=False),
    Column("adapter", String(64), nullable=True),
    Column("priority", String(16), nullable=False),
    Column("routed_from", String(200), nullable=True),  # what `model` asked for when a router chose
    Column("route_score", Float, nullable=True),  # the router's score (0-1) when it chose (calibration reads it)
    Column("endpoint", String(32), nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("ttft_ms", Integer, nullable=True),
    Column("latency_ms", Integer, nullable=False),
    Column("status", String(32), nullable=False),
    Column("finish_reason", String(16), nullable=True),
    Column("price_id", Integer, nullable=True),  # the price in force at created_at, None: unpriced
    Column("currency", String(3), nullable=True),
    Column("cost_picos", BigInteger, nullable=True),
    PrimaryKeyConstraint("id", name="pk_usage_ledger"),
    UniqueConstraint("request_id", name="uq_usage_ledger_request_id"),
    CheckConstraint("prompt_tokens >= 0 AND cached_tokens >= 0 AND completion_tokens >= 0",
                    name="ck_usage_ledger_tokens"),
)
Index("ix_usage_ledger_tenant_id_created_at", usage_ledger.c.tenant_id, usage_ledger.c.created_at)
Index("ix_usage_ledger_created_at", usage_ledger.c.created_at)

usage_daily = Table(
    "usage_daily", metadata,
    Column("id", Id, nullable=False, autoincrement=True),
    Column("day", Date, nullable=False),
    Column("tenant_id", Integer, nullable=False),
    Column("key_id", Integer, nullable=False),
    Column("model", String(200), nullable=False),
    Column("adapter", String(64), nullable=False),  # '' for the base model
    Column("price_id", Integer, nullable=False),  # 0: no price was in force
    Column("requests", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("cached_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("cost_picos", BigInteger, nullable=False),
    PrimaryKeyConstraint("id", name="pk_usage_daily"),
    UniqueConstraint("day", "tenant_id", "key_id", "model", "adapter", "price_id", name="uq_usage_daily_grain"),
)
Index("ix_usage_daily_tenant_id_day", usage_daily.c.tenant_id, usage_daily.c.day)

prices = Table(
    "prices", metadata,
    Column("id", Integer, nullable=False, autoincrement=True),
    Column("model", String(200), nullable=False),
    Column("currency", String(3), nullable=False),
    Column("input_micros", BigInteger, nullable=False),  # per 1M uncached prompt tokens
    Column("cached_input_micros", BigInteger, nullable=False),  # per 1M prompt tokens served from cache
    Column("output_micros", BigInteger, nullable=False),  # per 1M completion tokens
    Column("effective_from", DateTime(timezone=True), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("id", name="pk_prices"),
    UniqueConstraint("model", "effective_from", name="uq_prices_model_effective_from"),
    CheckConstraint("input_micros >= 0 AND cached_input_micros >= 0 AND output_micros >= 0",
                    name="ck_prices_non_negative"),
)
