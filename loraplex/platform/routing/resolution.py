"""Model resolution over a short-lived cache of the catalog, and adapter loading.

- `model` is "<base>", "<base>:<adapter>" or "<adapter>"; adapters are looked up in the caller's tenant only, and
  whatever the key may not use answers exactly as a model that does not exist.
- The catalog is cached for `catalog_cache_ttl_s` (cache.py: entries in use are re-read in the background); while
  the database is down, the cached catalog keeps serving for a while (outage.py).
- What the cache holds is bounded by the catalog, not by what clients ask for: a name longer than MAX_NAME_CHARS, or
  holding a control character (no name can: Postgres refuses NUL in text), answers 404 without a lookup, and an
  adapter that does not exist is looked up again next time rather than remembered per requested string.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import anyio
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.billing.prices import PriceBook
from loraplex.engine.api import EngineClient, EngineError, ModelNotFoundError
from loraplex.platform.auth import Principal
from loraplex.platform.background import Background
from loraplex.platform.cache import RefreshingCache
from loraplex.platform.errors import PlatformError, model_not_found
from loraplex.platform.tenancy.catalog import auto_models, existing_engine_ids, find_adapter, list_models

log = logging.getLogger("loraplex.platform")
MAX_NAME_CHARS = 256  # a model or adapter name; a longer one answers 404 without a lookup


@dataclass(frozen=True)
class AdapterRef:
    name: str
    base_model: str
    engine_id: str
    path: str


@dataclass(frozen=True)
class Target:
    """Where a request goes: a base model, and maybe one of the tenant's adapters on it."""

    requested: str
    base_model: str
    adapter: AdapterRef | None = None
    complexity: float | None = None  # the score, when `auto` chose the model (routing/auto.py)

    @property
    def routed_from(self) -> str | None:
        return self.requested if self.complexity is not None else None


@dataclass(frozen=True)
class AutoPool:
    """The base models `auto` may choose, each with its auto_max_complexity, and their prices."""

    models: dict[str, float]
    prices: PriceBook


class ModelRouter:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl_s: float = 2.0, clock=time.monotonic,
                 outage_grace_s: float = 900.0):
        self._sessions = sessions
        self._models: RefreshingCache[None, frozenset[str]] = RefreshingCache(
            self._load_models, ttl_s, what="models", grace_s=outage_grace_s, clock=clock)
        self._adapters: RefreshingCache[tuple[int, str], AdapterRef | None] = RefreshingCache(
            self._load_adapter, ttl_s, what="adapters", grace_s=outage_grace_s, clock=clock,
            keep=lambda ref: ref is not None)
        self._auto: RefreshingCache[None, AutoPool] = RefreshingCache(
            self._load_auto, ttl_s, what="auto models", grace_s=outage_grace_s, clock=clock)

    @property
    def cached_adapters(self) -> int:
        """How many adapters the cache holds (tests, diagnostics): only ones that exist."""
        return len(self._adapters)

    def invalidate(self) -> None:
        self._models.invalidate()
        self._adapters.invalidate()
        self._auto.invalidate()

    async def auto_pool(self) -> AutoPool:
        return await self._auto.get(None)

    async def _load_auto(self, _: None) -> AutoPool:
        async with self._sessions() as session:
            models = await auto_models(session)
            return AutoPool(models, await PriceBook.load(session, models))

    async def base_models(self) -> frozenset[str]:
        return await self._models.get(None)

    async def _load_models(self, _: None) -> frozenset[str]:
        async with self._sessions() as session:
            return frozenset(m.name for m in await list_models(session))

    async def adapter(self, tenant_id: int, name: str) -> AdapterRef | None:
        return await self._adapters.get((tenant_id, name))

    async def _load_adapter(self, key: tuple[int, str]) -> AdapterRef | None:
        async with self._sessions() as session:
            row = await find_adapter(session, *key)
            return None if row is None else AdapterRef(row.name, row.base_model.name, row.engine_id, row.path)

    async def resolve(self, principal: Principal, requested: str) -> Target:
        if len(requested) > MAX_NAME_CHARS or not requested.isprintable():
            raise model_not_found(requested)
        bases = await self.base_models()
        if requested in bases:
            if not model_allowed(principal, requested):
                raise model_not_found(requested)
            return Target(requested, requested)
        base, sep, name = requested.rpartition(":")
        if sep and base not in bases:
            raise model_not_found(requested)
        ref = await self.adapter(principal.tenant_id, name) if name and ":" not in name else None
        if ref is None or (sep and ref.base_model != base) or not _adapter_allowed(principal, ref):
            raise model_not_found(requested)
        return Target(requested, ref.base_model, ref)


def model_allowed(principal: Principal, model: str) -> bool:
    return principal.allowed_models is None or model in principal.allowed_models


def _adapter_allowed(principal: Principal, ref: AdapterRef) -> bool:
    if not model_allowed(principal, ref.base_model):
        return False
    return principal.allowed_adapters is None or ref.name in principal.allowed_adapters


class EngineAdapters:
    """Registers adapters with the engine, on their base model, the first time this instance needs
    them, so an adapter registered through another instance (or before a restart) loads on demand;
    takes deleted ones out of it.

    Engine ids are never reused (a row's id and creation time), so an id once retired here is
    refused for good: a request that resolved the adapter just before its deletion cannot register
    it again behind the deletion's back."""

    def __init__(self, engine: EngineClient):
        self._engine = engine
        self._loaded: dict[str, str] = {}  # engine id -> its base model, as registered in this engine
        self._uncommitted: set[str] = set()  # registered for a row not yet committed
        self._retired: set[str] = set()
        self._removals = Background()
        self._lock = asyncio.Lock()

    async def add(self, engine_id: str, path: str, base_model: str, *, uncommitted: bool = False) -> None:
        """Validates and registers (raises EngineError); parsing runs off the event loop.
        `uncommitted`: for a row being written, which `committed` then confirms (until then a
        sweep leaves it alone)."""
        async with self._lock:
            if engine_id in self._retired:
                raise ModelNotFoundError(f"adapter {engine_id!r} was deleted", "adapter")
            if engine_id not in self._loaded:
                await anyio.to_thread.run_sync(self._engine.add_adapter, engine_id, path, base_model)
                self._loaded[engine_id] = base_model
            if uncommitted:
                self._uncommitted.add(engine_id)

    def committed(self, engine_id: str) -> None:
        self._uncommitted.discard(engine_id)

    async def remove(self, engine_id: str) -> None:
        """Returns once the engine has dropped it (its running requests finish first)."""
        async with self._lock:
            base_model = self._loaded.pop(engine_id, None)
            self._uncommitted.discard(engine_id)
        if base_model is not None:
            await self._engine.remove_adapter(engine_id, base_model)

    def retire(self, engine_id: str) -> None:
        """For a deleted adapter: refused from now on; the engine drops it once its running
        requests finish, in the background."""
        self._retired.add(engine_id)
        self._removals.spawn(self.remove(engine_id), name=f"remove-adapter-{engine_id}")

    async def drain(self) -> None:
        await self._removals.drain()

    async def sweep(self, sessions: async_sessionmaker[AsyncSession]) -> list[str]:
        """Retires what this engine holds for adapters deleted through another instance (their
        rows are gone); returns their engine ids."""
        held = [e for e in self._loaded if e not in self._retired and e not in self._uncommitted]
        if not held:
            return []
        async with sessions() as session:
            alive = await existing_engine_ids(session, held)
        gone = [e for e in held if e not in alive and e not in self._uncommitted]
        for engine_id in gone:
            self.retire(engine_id)
        return gone

    async def run_sweeps(self, sessions: async_sessionmaker[AsyncSession], interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                if gone := await self.sweep(sessions):
                    log.info("dropping %d adapters deleted elsewhere: %s", len(gone), ", ".join(gone))
            except Exception as exc:  # the database is down, say: the next sweep tries again
                log.warning("adapter sweep failed: %s", type(exc).__name__)

    async def ensure(self, ref: AdapterRef, requested: str) -> None:
        """`requested`: the model as the client named it, for the 404 of an adapter deleted since
        it was resolved."""
        if ref.engine_id in self._loaded and ref.engine_id not in self._retired:
            return
        try:
            await self.add(ref.engine_id, ref.path, ref.base_model)
        except ModelNotFoundError:
            raise model_not_found(requested) from None
        except EngineError as exc:
            log.error("adapter %s (%s) failed to load: %s", ref.name, ref.engine_id, exc.message)
            raise PlatformError(503, f"Adapter `{ref.name}` could not be loaded; ask the operator to check it.",
                                code="adapter_unavailable") from None
