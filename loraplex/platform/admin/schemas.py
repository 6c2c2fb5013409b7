"""Admin API bodies (msgspec structs), and the row -> body conversions shared with the CLI."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from msgspec import Meta, Struct

from loraplex.platform.db.tables import Adapter, ApiKey, Model, Tenant, as_utc

PositiveInt = Annotated[int, Meta(ge=1)]
MAX_KEY_LIFETIME_S = 100 * 366 * 86_400  # expires_in_s: far enough, and a date Python and Postgres can hold


class TenantIn(Struct, kw_only=True):
    name: str
    tier: str = "standard"
    default_max_tokens: int | None = None  # caps requests without max_tokens (None: the platform default)


class TenantOut(Struct):
    id: int
    name: str
    tier: str
    status: str
    created_at: datetime
    default_max_tokens: int | None


class KeyIn(Struct, kw_only=True):
    """expires_at (an absolute time) or expires_in_s; lists None mean every model / adapter."""

    name: str | None = None
    expires_at: datetime | None = None
    expires_in_s: Annotated[int, Meta(ge=1, le=MAX_KEY_LIFETIME_S)] | None = None
    allowed_models: list[str] | None = None
    allowed_adapters: list[str] | None = None
    max_priority: str = "standard"
    rpm_limit: PositiveInt | None = None
    tpm_limit: PositiveInt | None = None


class KeyOut(Struct):
    prefix: str
    tenant: str
    name: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    allowed_models: list[str] | None
    allowed_adapters: list[str] | None
    max_priority: str
    rpm_limit: int | None
    tpm_limit: int | None


class KeyCreated(KeyOut):
    key: str  # shown this once; only its sha256 is stored


class ModelIn(Struct, kw_only=True):
    name: str
    source: str | None = None  # what the engine loads; defaults to the name
    auto_max_complexity: float | None = None  # in `auto`'s pool up to this complexity (0-1); None: not


class AutoRouteIn(Struct, kw_only=True):
    auto_max_complexity: float | None  # null takes the model out of `auto`'s pool


class ModelOut(Struct):
    id: int
    name: str
    source: str
    auto_max_complexity: float | None
    created_at: datetime


class AdapterIn(Struct, kw_only=True):
    """One of `path` (a PEFT directory the engine can read) or `files` (each PEFT file name mapped to
    the digest of a blob uploaded to the store: "sha256:<hex>")."""

    name: str
    base_model: str
    path: str | None = None
    files: dict[str, str] | None = None


class AdapterOut(Struct):
    id: int
    tenant: str
    name: str
    base_model: str
    path: str
    engine_id: str
    created_at: datetime


class BlobOut(Struct):
    digest: str  # sha256:<hex>
    size: int


def tenant_out(t: Tenant) -> TenantOut:
    return TenantOut(t.id, t.name, t.tier, t.status, as_utc(t.created_at), t.default_max_tokens)


def key_out(k: ApiKey) -> KeyOut:
    return KeyOut(k.prefix, k.tenant.name, k.name, as_utc(k.created_at), as_utc(k.expires_at), as_utc(k.revoked_at),
                  k.allowed_models, k.allowed_adapters, k.max_priority, k.rpm_limit, k.tpm_limit)


def model_out(m: Model) -> ModelOut:
    return ModelOut(m.id, m.name, m.source, m.auto_max_complexity, as_utc(m.created_at))


def adapter_out(a: Adapter, tenant: str) -> AdapterOut:
    return AdapterOut(a.id, tenant, a.name, a.base_model.name, a.path, a.engine_id, as_utc(a.created_at))
