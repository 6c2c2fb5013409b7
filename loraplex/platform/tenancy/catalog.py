"""Base models (name, source, auto_max_complexity) and the adapters tenants register on them (name,
base model, path). "auto" names the complexity router (routing/auto.py), so no model or adapter may
take that name."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db.tables import Adapter, Model
from loraplex.platform.errors import conflict, invalid, not_found, shown
from loraplex.platform.tenancy.common import check_name, commit_or_conflict
from loraplex.platform.tenancy.tenants import get_tenant

AUTO = "auto"
MAX_SOURCE_CHARS = 1000  # the widths of the source and path columns
MAX_PATH_CHARS = 4096


def _check_model_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 200 or any(c.isspace() for c in name):
        raise invalid(f"model name must be 1-200 characters without spaces, got "
                      f"{shown(name) if isinstance(name, str) else name!r}", "name")
    return check_not_auto(name, "model")


def check_not_auto(name: str, what: str, param: str = "name") -> str:
    if name == AUTO:
        raise invalid(f"{what} name {AUTO!r} is reserved for routing by request complexity", param)
    return name


def check_max_complexity(value: float | None) -> float | None:
    """None keeps a model out of `auto`; else the most complex request (0-1) it should take."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0 <= value <= 1:
        raise invalid(f"auto_max_complexity must be a number from 0 to 1, or null, got {value!r}",
                      "auto_max_complexity")
    return float(value)


def parse_max_complexity(raw: str) -> float | None:
    """A limit as typed in a form or on the command line: blank is None (out of the pool)."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise invalid(f"auto_max_complexity must be a number from 0 to 1, got {raw!r}", "auto_max_complexity") \
            from None
    return check_max_complexity(value)


async def find_model(session: AsyncSession, name: str) -> Model | None:
    return (await session.execute(select(Model).where(Model.name == name))).scalar_one_or_none()


async def register_model(session: AsyncSession, name: str, source: str | None = None,
                         auto_max_complexity: float | None = None) -> Model:
    _check_model_name(name)
    auto_max_complexity = check_max_complexity(auto_max_complexity)
    source = source or name
    if not isinstance(source, str) or len(source) > MAX_SOURCE_CHARS:
        raise invalid(f"source must be at most {MAX_SOURCE_CHARS} characters", "source")
    if await find_model(session, name) is not None:
        raise conflict(f"model {name!r} already exists", "name")

    async def work() -> Model:
        row = Model(name=name, source=source, auto_max_complexity=auto_max_complexity)
        session.add(row)
        await session.flush()
        return row

    return await commit_or_conflict(session, f"model {name!r}", work)


async def ensure_model(session: AsyncSession, name: str, source: str | None = None) -> Model:
    """The model row, registered if missing (the server registers what its engine serves)."""
    return await find_model(session, name) or await register_model(session, name, source)


async def set_auto_route(session: AsyncSession, name: str, auto_max_complexity: float | None) -> Model:
    """Puts a model in `auto`'s pool (taking requests up to that complexity) or, with None, out of it."""
    value = check_max_complexity(auto_max_complexity)
    row = await find_model(session, name)
    if row is None:
        raise not_found(f"model {shown(name)!r} is not registered", "name", code="model_not_found")
    row.auto_max_complexity = value
    await session.commit()
    return row


async def auto_models(session: AsyncSession) -> dict[str, float]:
    """The models in `auto`'s pool: name -> auto_max_complexity."""
    rows = await session.execute(select(Model.name, Model.auto_max_complexity)
                                 .where(Model.auto_max_complexity.is_not(None)))
    return {name: value for name, value in rows.all()}


async def list_models(session: AsyncSession) -> list[Model]:
    return list((await session.execute(select(Model).order_by(Model.id))).scalars())


async def register_adapter(session: AsyncSession, tenant_name: str, name: str, base_model: str, path: str,
                           validate: Callable[[Adapter], Awaitable[None]] | None = None) -> Adapter:
    """Inserts the row, lets `validate` check it against the engine (it gets the row with its id),
    and commits only if that passes: a bad adapter leaves no row."""
    check_not_auto(check_name(name, "adapter"), "adapter")
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS:
        raise invalid(f"path must be the adapter's directory (at most {MAX_PATH_CHARS} characters)", "path")
    tenant = await get_tenant(session, tenant_name)
    model = await find_model(session, base_model)
    if model is None:
        raise not_found(f"base model {shown(base_model)!r} is not registered", "base_model", code="model_not_found")
    if await find_adapter(session, tenant.id, name) is not None:
        raise conflict(f"adapter {name!r} already exists for tenant {tenant_name!r}", "name")

    async def work() -> Adapter:
        row = Adapter(tenant_id=tenant.id, name=name, base_model_id=model.id, path=path)
        session.add(row)
        await session.flush()
        row.base_model = model
        if validate is not None:
            await validate(row)
        return row

    return await commit_or_conflict(session, f"adapter {name!r}", work)


async def find_adapter(session: AsyncSession, tenant_id: int, name: str) -> Adapter | None:
    query = select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name)
    return (await session.execute(query)).scalar_one_or_none()


async def delete_adapter(session: AsyncSession, tenant_name: str, name: str) -> Adapter:
    """Deletes the tenant's adapter row and returns it (404 when there is none). Usage rows name
    the model as it was requested, so the ledger keeps its history."""
    tenant = await get_tenant(session, tenant_name)
    row = await find_adapter(session, tenant.id, name)
    if row is None:
        raise not_found(f"adapter {shown(name)!r} not found for tenant {tenant_name!r}", "name")
    await session.delete(row)
    await session.commit()
    return row


async def existing_engine_ids(session: AsyncSession, engine_ids: list[str]) -> set[str]:
    """Those of `engine_ids` whose adapter rows still exist."""
    row_ids = {i for i in map(Adapter.row_id_of, engine_ids) if i is not None}
    if not row_ids:
        return set()
    rows = (await session.execute(select(Adapter).where(Adapter.id.in_(row_ids)))).scalars()
    return {row.engine_id for row in rows} & set(engine_ids)


async def list_adapters(session: AsyncSession, tenant_id: int) -> list[Adapter]:
    query = select(Adapter).where(Adapter.tenant_id == tenant_id).order_by(Adapter.id)
    return list((await session.execute(query)).scalars())
