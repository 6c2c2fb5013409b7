"""The admin API under /admin/api/: tenants, keys, models, adapters, engine stats.

Every call needs `Authorization: Bearer $LORAPLEX_ADMIN_TOKEN` (compared in constant time);
without a configured token the admin API refuses everything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from datetime import timedelta

import msgspec
from litestar import Router, delete, get, patch, post
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, JSONBody

from loraplex.engine.api import EngineError, ReplicaInfo
from loraplex.platform.admin import schemas as a
from loraplex.platform.admin.adapter_store_api import adapter_path, adapter_store_handlers
from loraplex.platform.admin.auto_api import auto_handlers
from loraplex.platform.admin.billing_schemas import TenantPatch
from loraplex.platform.db.tables import Adapter, utcnow
from loraplex.platform.errors import PlatformError, from_engine_error
from loraplex.platform.state import PlatformDep
from loraplex.platform.tenancy import catalog, keys, tenants


def admin_token_ok(configured: str | None, given: str) -> bool:
    """Whether `given` is the configured admin token (none configured: nothing is), in constant time."""
    return bool(configured) and hmac.compare_digest(given.strip().encode(), configured.encode())


def check_admin_token(connection: ASGIConnection, given: str) -> bool:
    """`admin_token_ok` for a client, counted against its address: one that sent too many wrong
    tokens lately gets a 429 instead, whatever it sends (auth_throttle.py). No token at all is no
    guess, and is not counted."""
    platform = connection.app.state.platform
    address = connection.client.host if connection.client else "unknown"
    platform.admin_throttle.check(address)
    if not given.strip():
        return False
    ok = admin_token_ok(platform.settings.admin_token, given)
    platform.admin_throttle.record(address, ok)
    return ok


def admin_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    if not connection.app.state.platform.settings.admin_token:
        raise PlatformError(403, "The admin API is disabled: set LORAPLEX_ADMIN_TOKEN to enable it.",
                            code="admin_disabled")
    scheme, _, given = (connection.headers.get("authorization") or "").partition(" ")
    if not check_admin_token(connection, given if scheme.lower() == "bearer" else ""):
        raise PlatformError(401, "Invalid admin token.", code="invalid_admin_token")


@post("/tenants", status_code=201)
async def create_tenant(platform: PlatformDep, data: JSONBody[a.TenantIn]) -> a.TenantOut:
    async with platform.sessions() as session:
        return a.tenant_out(await tenants.create_tenant(session, data.name, data.tier, data.default_max_tokens))


@get("/tenants")
async def list_tenants(platform: PlatformDep) -> list[a.TenantOut]:
    async with platform.sessions() as session:
        return [a.tenant_out(t) for t in await tenants.list_tenants(session)]


@get("/tenants/{name:str}")
async def get_tenant(platform: PlatformDep, name: FromPath[str]) -> a.TenantOut:
    async with platform.sessions() as session:
        return a.tenant_out(await tenants.get_tenant(session, name))


@patch("/tenants/{name:str}", status_code=200)
async def update_tenant(platform: PlatformDep, name: FromPath[str], data: JSONBody[TenantPatch]) -> a.TenantOut:
    async with platform.sessions() as session:
        tenant = await tenants.set_default_max_tokens(session, name, data.default_max_tokens)
    platform.catalog_changed()
    return a.tenant_out(tenant)


@post("/tenants/{name:str}/disable", status_code=200)
async def disable_tenant(platform: PlatformDep, name: FromPath[str]) -> a.TenantOut:
    return a.tenant_out(await platform.set_tenant_status(name, "disabled"))


@post("/tenants/{name:str}/enable", status_code=200)
async def enable_tenant(platform: PlatformDep, name: FromPath[str]) -> a.TenantOut:
    return a.tenant_out(await platform.set_tenant_status(name, "active"))


@post("/tenants/{name:str}/keys", status_code=201)
async def create_key(platform: PlatformDep, name: FromPath[str], data: JSONBody[a.KeyIn]) -> a.KeyCreated:
    if data.expires_at is not None and data.expires_in_s is not None:
        raise PlatformError(400, "give expires_at or expires_in_s, not both", param="expires_in_s")
    expires = data.expires_at or (utcnow() + timedelta(seconds=data.expires_in_s) if data.expires_in_s else None)
    spec = keys.KeySpec(
        name=data.name, expires_at=expires, max_priority=data.max_priority, rpm_limit=data.rpm_limit,
        tpm_limit=data.tpm_limit,
        allowed_models=tuple(data.allowed_models) if data.allowed_models is not None else None,
        allowed_adapters=tuple(data.allowed_adapters) if data.allowed_adapters is not None else None)
    async with platform.sessions() as session:
        row, secret = await keys.create_key(session, name, spec)
    return a.KeyCreated(**msgspec.structs.asdict(a.key_out(row)), key=secret)


@get("/tenants/{name:str}/keys")
async def list_keys(platform: PlatformDep, name: FromPath[str]) -> list[a.KeyOut]:
    async with platform.sessions() as session:
        return [a.key_out(k) for k in await keys.list_keys(session, name)]


@post("/keys/{prefix:str}/revoke", status_code=200)
async def revoke_key(platform: PlatformDep, prefix: FromPath[str]) -> a.KeyOut:
    return a.key_out(await platform.revoke_key(prefix))


@get("/models")
async def list_models(platform: PlatformDep) -> list[a.ModelOut]:
    async with platform.sessions() as session:
        return [a.model_out(m) for m in await catalog.list_models(session)]


@post("/models", status_code=201)
async def register_model(platform: PlatformDep, data: JSONBody[a.ModelIn]) -> a.ModelOut:
    async with platform.sessions() as session:
        row = await catalog.register_model(session, data.name, data.source, data.auto_max_complexity)
    platform.catalog_changed()
    return a.model_out(row)


@patch("/models/{name:path}")
async def set_auto_route(platform: PlatformDep, name: FromPath[str], data: JSONBody[a.AutoRouteIn]) -> a.ModelOut:
    """Puts the model in `auto`'s pool up to a request complexity, or (null) takes it out."""
    return a.model_out(await platform.set_auto_route(name.lstrip("/"), data.auto_max_complexity))


@get("/tenants/{name:str}/adapters")
async def list_adapters(platform: PlatformDep, name: FromPath[str]) -> list[a.AdapterOut]:
    async with platform.sessions() as session:
        tenant = await tenants.get_tenant(session, name)
        return [a.adapter_out(x, name) for x in await catalog.list_adapters(session, tenant.id)]


@post("/tenants/{name:str}/adapters", status_code=201)
async def register_adapter(platform: PlatformDep, name: FromPath[str], data: JSONBody[a.AdapterIn]) -> a.AdapterOut:
    """The engine validates the PEFT directory before the row is committed; a bad one leaves nothing
    (and an adapter the engine took for a row that then failed to commit is taken back)."""
    path = await adapter_path(platform, data)
    added: list[str] = []

    async def validate(row: Adapter) -> None:
        try:
            await platform.adapters.add(row.engine_id, row.path, row.base_model.name, uncommitted=True)
        except EngineError as exc:
            raise PlatformError(400, f"adapter rejected by the engine: {from_engine_error(exc).message}",
                                code="invalid_adapter", param="path" if data.files is None else "files") from None
        added.append(row.engine_id)

    try:
        async with platform.sessions() as session:
            row = await catalog.register_adapter(session, name, data.name, data.base_model, path, validate)
    except BaseException:
        for engine_id in added:
            await platform.adapters.remove(engine_id)
        raise
    platform.adapters.committed(row.engine_id)
    platform.catalog_changed()
    return a.adapter_out(row, name)


@delete("/tenants/{name:str}/adapters/{adapter:str}", status_code=204)
async def delete_adapter(platform: PlatformDep, name: FromPath[str], adapter: FromPath[str]) -> None:
    """New requests for it answer 404 at once (on other instances within the catalog cache's
    lifetime); its running requests finish, then the engine drops it."""
    await platform.delete_adapter(name, adapter)


@get("/engine/stats")
async def engine_stats(platform: PlatformDep) -> dict:
    """The engine's figures as its components report them (requests, kv, adapters, speculation, models, memory),
    and the compute path that runs it (None with replicas elsewhere; found off the event loop, once)."""
    path = await asyncio.to_thread(platform.engine.compute_path)
    return {**platform.engine.stats().as_dict(), "compute": None if path is None else dataclasses.asdict(path)}


@get("/engine/replicas")
async def engine_replicas(platform: PlatformDep) -> list[ReplicaInfo]:
    """The engine replicas behind this gateway (`serve --ray`), as its last status poll found them;
    empty when the engine runs in this process."""
    return platform.engine.replicas()


admin_router = Router(
    path="/admin/api", guards=[admin_guard], tags=["admin"],
    route_handlers=[create_tenant, list_tenants, get_tenant, update_tenant, disable_tenant, enable_tenant, create_key,
                    list_keys, revoke_key, list_models, register_model, set_auto_route, list_adapters,
                    register_adapter, delete_adapter, engine_stats, engine_replicas, *adapter_store_handlers,
                    *auto_handlers])
