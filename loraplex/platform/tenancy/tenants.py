"""Tenants: create, list, look up, disable and enable, and their default max_tokens."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.tables import Tenant
from loraplex.platform.errors import conflict, invalid, not_found, shown
from loraplex.platform.tenancy.common import check_name, commit_or_conflict

STATUSES = ("active", "disabled")
MAX_TIER_CHARS = 32  # the tier column's width
MAX_INT_COLUMN = 2**31 - 1  # default_max_tokens is a 32-bit integer column


def _check_max_tokens(value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 1 <= value <= MAX_INT_COLUMN):
        raise invalid(f"default_max_tokens must be an integer from 1 to {MAX_INT_COLUMN}, got {value!r}",
                      "default_max_tokens")
    return value


async def create_tenant(session: AsyncSession, name: str, tier: str = "standard",
                        default_max_tokens: int | None = None) -> Tenant:
    check_name(name, "tenant")
    check_name(tier, "tier", "tier")
    if len(tier) > MAX_TIER_CHARS:
        raise invalid(f"tier must be at most {MAX_TIER_CHARS} characters", "tier")
    _check_max_tokens(default_max_tokens)
    if await find_tenant(session, name) is not None:
        raise conflict(f"tenant {name!r} already exists", "name")

    async def work() -> Tenant:
        tenant = Tenant(name=name, tier=tier, status="active", default_max_tokens=default_max_tokens)
        session.add(tenant)
        await session.flush()
        return tenant

    return await commit_or_conflict(session, f"tenant {name!r}", work)


async def find_tenant(session: AsyncSession, name: str) -> Tenant | None:
    return (await session.execute(select(Tenant).where(Tenant.name == name))).scalar_one_or_none()


async def get_tenant(session: AsyncSession, name: str) -> Tenant:
    tenant = await find_tenant(session, name)
    if tenant is None:
        raise not_found(f"tenant {shown(name)!r} not found", "tenant")
    return tenant


async def list_tenants(session: AsyncSession) -> list[Tenant]:
    return list((await session.execute(select(Tenant).order_by(Tenant.id))).scalars())


async def set_status(session: AsyncSession, name: str, status: str) -> Tenant:
    if status not in STATUSES:
        raise invalid(f"status must be one of {', '.join(STATUSES)}, got {status!r}", "status")
    tenant = await get_tenant(session, name)
    tenant.status = status
    await session.commit()
    return tenant


async def set_default_max_tokens(session: AsyncSession, name: str, value: int | None) -> Tenant:
    """What a request of this tenant without max_tokens may generate (None: the platform default)."""
    _check_max_tokens(value)
    tenant = await get_tenant(session, name)
    tenant.default_max_tokens = value
    await session.commit()
    return tenant
