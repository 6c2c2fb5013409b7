"""Tenants: create, list, look up, disable and enable."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.tables import Tenant
from loraplex.platform.errors import conflict, invalid, not_found
from loraplex.platform.tenancy.common import check_name, commit_or_conflict

STATUSES = ("active", "disabled")


async def create_tenant(session: AsyncSession, name: str, tier: str = "standard") -> Tenant:
    check_name(name, "tenant")
    check_name(tier, "tier", "tier")
    if await find_tenant(session, name) is not None:
        raise conflict(f"tenant {name!r} already exists", "name")

    async def work() -> Tenant:
        tenant = Tenant(name=name, tier=tier, status="active")
        session.add(tenant)
        await session.flush()
        return tenant

    return await commit_or_conflict(session, f"tenant {name!r}", work)


async def find_tenant(session: AsyncSession, name: str) -> Tenant | None:
    return (await session.execute(select(Tenant).where(Tenant.name == name))).scalar_one_or_none()


async def get_tenant(session: AsyncSession, name: str) -> Tenant:
    tenant = await find_tenant(session, name)
    if tenant is None:
        raise not_found(f"tenant {name!r} not found", "tenant")
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
