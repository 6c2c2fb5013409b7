"""Where each registered adapter's weights are now, from the engine's stats: in a device slot, in
the CPU tier (parsed, ready to copy into a slot), or only on disk (read on its next request)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.engine.api import EngineStats
from loraplex.platform.db.tables import Adapter, Tenant

MAX_LISTED = 200  # the overview lists this many adapters (the tenant pages list all of theirs)


@dataclass(frozen=True)
class AdapterView:
    tenant: str
    name: str
    base_model: str
    residency: str  # device, CPU or disk
    running: bool  # a request on it runs now


def residency(engine_id: str, stats: EngineStats) -> str:
    if engine_id in stats.adapters.device:
        return "device"
    return "CPU" if engine_id in stats.adapters.cpu else "disk"


def view(adapter: Adapter, tenant: str, stats: EngineStats) -> AdapterView:
    engine_id = adapter.engine_id
    return AdapterView(tenant, adapter.name, adapter.base_model.name, residency(engine_id, stats),
                       engine_id in stats.adapters.running)


async def every_adapter(session: AsyncSession, stats: EngineStats) -> tuple[list[AdapterView], int]:
    """The first MAX_LISTED adapters by tenant and name, and how many there are in all."""
    query = (select(Adapter, Tenant.name).join(Tenant, Tenant.id == Adapter.tenant_id)
             .order_by(Tenant.name, Adapter.name).limit(MAX_LISTED))
    rows = (await session.execute(query)).all()
    count = (await session.execute(select(func.count()).select_from(Adapter))).scalar_one()
    return [view(adapter, tenant, stats) for adapter, tenant in rows], int(count)
