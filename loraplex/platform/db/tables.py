"""The platform's tables. The schema itself is made only by the Alembic migrations in migrations/;
these classes, and billing's tables (`METADATA` has both), must match them
(tests/integration/test_migrations.py checks)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from loraplex.billing.periods import BUDGET_PERIODS
from loraplex.billing.tables import metadata as billing_metadata

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("status IN ('active', 'disabled')", name="status"),
        CheckConstraint("default_max_tokens IS NULL OR default_max_tokens > 0", name="default_max_tokens"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    tier: Mapped[str] = mapped_column(String(32), default="standard")
    status: Mapped[str] = mapped_column(String(16), default="active")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Caps what a request without max_tokens may generate (and so what it reserves of a budget).
    default_max_tokens: Mapped[int | None] = mapped_column(Integer)


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint("max_priority IN ('realtime', 'standard', 'batch')", name="max_priority"),
        CheckConstraint("rpm_limit IS NULL OR rpm_limit > 0", name="rpm_limit"),
        CheckConstraint("tpm_limit IS NULL OR tpm_limit > 0", name="tpm_limit"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    allowed_models: Mapped[list | None] = mapped_column(JSON)  # None: every model
    allowed_adapters: Mapped[list | None] = mapped_column(JSON)  # None: every adapter of the tenant
    max_priority: Mapped[str] = mapped_column(String(16), default="standard")
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)

    tenant: Mapped[Tenant] = relationship(lazy="joined")


class Model(Base):
    __tablename__ = "models"
    __table_args__ = (
        CheckConstraint("auto_max_complexity IS NULL OR (auto_max_complexity >= 0 AND auto_max_complexity <= 1)",
                        name="auto_max_complexity"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(String(1000))
    # in `auto`'s pool, taking requests up to this complexity (0-1); NULL: never chosen by `auto`
    auto_max_complexity: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    base_model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="RESTRICT"))
    path: Mapped[str] = mapped_column(String(4096))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    base_model: Mapped[Model] = relationship(lazy="joined")

    @property
    def engine_id(self) -> str:
        """The engine's adapter id: the row's id, unique across tenants, and its creation time in
        microseconds, so an id SQLite hands out again after a deletion never names the old adapter
        (an engine, or another instance's, may still hold that one)."""
        return f"adapter-{self.id}-{(as_utc(self.created_at) - _EPOCH) // _MICROSECOND}"

    @staticmethod
    def row_id_of(engine_id: str) -> int | None:
        """The row id an engine id names (None for anything else)."""
        prefix, _, rest = engine_id.partition("-")
        row_id = rest.partition("-")[0]
        return int(row_id) if prefix == "adapter" and row_id.isdigit() else None


class Budget(Base):
    """A token budget of a tenant (key_id None) or of one of its keys, per period; one per scope
    and period (partial unique indexes, since NULLs never collide in a plain one)."""

    __tablename__ = "budgets"
    __table_args__ = (
        CheckConstraint(f"period IN ({', '.join(repr(p) for p in BUDGET_PERIODS)})", name="period"),
        CheckConstraint("limit_tokens > 0", name="limit_tokens"),
        CheckConstraint("soft_limit_tokens IS NULL OR (soft_limit_tokens > 0 AND soft_limit_tokens <= limit_tokens)",
                        name="soft_limit_tokens"),
        Index("uq_budgets_tenant_id_period", "tenant_id", "period", unique=True,
              postgresql_where=text("key_id IS NULL"), sqlite_where=text("key_id IS NULL")),
        Index("uq_budgets_key_id_period", "key_id", "period", unique=True,
              postgresql_where=text("key_id IS NOT NULL"), sqlite_where=text("key_id IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    period: Mapped[str] = mapped_column(String(8))
    limit_tokens: Mapped[int] = mapped_column(BigInteger)
    soft_limit_tokens: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    tenant: Mapped[Tenant] = relationship(lazy="joined")
    key: Mapped[ApiKey | None] = relationship(lazy="joined")


METADATA = (Base.metadata, billing_metadata)  # everything the migrations make
