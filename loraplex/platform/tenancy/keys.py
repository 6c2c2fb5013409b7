"""API keys: `lpx-` + a random secret, shown once; the database keeps its sha256 and a display prefix."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.engine.api import PRIORITY_CLASSES
from loraplex.platform.db.tables import ApiKey, as_utc, utcnow
from loraplex.platform.errors import invalid, not_found
from loraplex.platform.tenancy.common import check_name, commit_or_conflict
from loraplex.platform.tenancy.tenants import get_tenant

KEY_MARK = "lpx-"
MAX_INT_COLUMN = 2**31 - 1  # rpm_limit and tpm_limit are 32-bit integer columns
MAX_SCOPE_NAMES = 1024  # names in allowed_models / allowed_adapters
MAX_SCOPE_NAME_CHARS = 256
PREFIX_LEN = len(KEY_MARK) + 8  # what lists and `keys revoke` show: lpx- and 8 characters of the secret


def new_secret() -> str:
    return KEY_MARK + secrets.token_urlsafe(32)  # 256 random bits


def hash_key(key: str) -> str:
    """A plain sha256 is enough: the secret has 256 random bits, nothing to brute-force."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def looks_like_key(value: str) -> bool:
    return value.startswith(KEY_MARK) and len(value) > PREFIX_LEN


@dataclass(frozen=True)
class KeySpec:
    """What a new key may do. None lists: every model / every adapter of the tenant."""

    name: str | None = None
    expires_at: datetime | None = None
    allowed_models: tuple[str, ...] | None = None
    allowed_adapters: tuple[str, ...] | None = None
    max_priority: str = "standard"
    rpm_limit: int | None = None
    tpm_limit: int | None = None

    def validate(self) -> None:
        if self.name is not None:
            check_name(self.name, "key")
        if self.max_priority not in PRIORITY_CLASSES:
            raise invalid(f"max_priority must be one of {', '.join(PRIORITY_CLASSES)}, got {self.max_priority!r}",
                          "max_priority")
        for field in ("rpm_limit", "tpm_limit"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= MAX_INT_COLUMN):
                raise invalid(f"{field} must be an integer from 1 to {MAX_INT_COLUMN}, got {value!r}", field)
        if self.expires_at is not None:
            try:
                expires = as_utc(self.expires_at).astimezone(UTC)
            except OverflowError:
                raise invalid("expires_at is out of range", "expires_at") from None
            if expires <= utcnow():
                raise invalid("expires_at must be in the future", "expires_at")
        for field in ("allowed_models", "allowed_adapters"):
            value = getattr(self, field)
            if value is not None and (len(value) > MAX_SCOPE_NAMES or not all(
                    isinstance(v, str) and 0 < len(v) <= MAX_SCOPE_NAME_CHARS for v in value)):
                raise invalid(f"{field} must be a list of at most {MAX_SCOPE_NAMES} names of 1-"
                              f"{MAX_SCOPE_NAME_CHARS} characters", field)


async def create_key(session: AsyncSession, tenant_name: str, spec: KeySpec = KeySpec()) -> tuple[ApiKey, str]:
    """Returns the row and the secret; the secret is not stored and cannot be shown again."""
    spec.validate()
    tenant = await get_tenant(session, tenant_name)
    secret = new_secret()

    async def work() -> ApiKey:
        row = ApiKey(
            tenant_id=tenant.id, prefix=secret[:PREFIX_LEN], secret_hash=hash_key(secret), name=spec.name,
            expires_at=as_utc(spec.expires_at).astimezone(UTC) if spec.expires_at is not None else None,
            allowed_models=list(spec.allowed_models) if spec.allowed_models is not None else None,
            allowed_adapters=list(spec.allowed_adapters) if spec.allowed_adapters is not None else None,
            max_priority=spec.max_priority, rpm_limit=spec.rpm_limit, tpm_limit=spec.tpm_limit)
        session.add(row)
        await session.flush()
        row.tenant = tenant
        return row

    return await commit_or_conflict(session, "a key with this prefix", work), secret


async def list_keys(session: AsyncSession, tenant_name: str) -> list[ApiKey]:
    tenant = await get_tenant(session, tenant_name)
    rows = await session.execute(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.id))
    return list(rows.scalars())


async def revoke_key(session: AsyncSession, prefix: str) -> ApiKey:
    """Revokes the key whose display prefix (or whole secret) is given. Revoking twice is fine."""
    prefix = prefix[:PREFIX_LEN]
    row = (await session.execute(select(ApiKey).where(ApiKey.prefix == prefix))).scalar_one_or_none()
    if row is None:
        raise not_found(f"no key with prefix {prefix!r}", "prefix")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        await session.commit()
    return row


async def find_by_secret_hash(session: AsyncSession, secret_hash: str) -> ApiKey | None:
    return (await session.execute(select(ApiKey).where(ApiKey.secret_hash == secret_hash))).scalar_one_or_none()
