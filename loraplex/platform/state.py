"""The services one app instance holds, built from settings and handed to every handler."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
from dataclasses import dataclass
from datetime import timedelta

from litestar.di import NamedDependency
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from loraplex.adapters.store import AdapterStore
from loraplex.billing.counters import CounterStore, MemoryCounters
from loraplex.billing.ledger import LedgerWriter
from loraplex.billing.prices import Price, PriceSpec
from loraplex.billing.quota import Quota
from loraplex.billing.rebuild import ledger_ids, tenant_usage
from loraplex.billing.spool import Spool
from loraplex.billing.tail import Tail
from loraplex.billing.usage import FanOutSink, UsageSink
from loraplex.engine.api import EngineClient
from loraplex.platform.admission import Admission
from loraplex.platform.auth import AuthCache
from loraplex.platform.auth_throttle import AdminAuthThrottle
from loraplex.platform.background import Background
from loraplex.platform.db.database import make_engine, session_factory
from loraplex.platform.db.tables import Adapter, ApiKey, Budget, Model, Tenant
from loraplex.platform.metrics import Metrics
from loraplex.platform.routing.learned import calibration
from loraplex.platform.routing.learned.calibration import Calibration
from loraplex.platform.routing.learned.scorer import Scorer, load_scorer
from loraplex.platform.routing.resolution import EngineAdapters, ModelRouter
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy import budgets, catalog, keys, tenants
from loraplex.platform.tenancy.prices import set_price


@dataclass(frozen=True)
class RunContext:
    """The services a generation run reports to (openai/generation.py)."""

    engine: EngineClient
    admission: Admission
    metrics: Metrics
    usage: UsageSink
    background: Background
    request_timeout_s: float = 0.0  # 0: none


@dataclass
class Platform:
    settings: Settings
    engine: EngineClient
    db: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    quota: Quota
    ledger: LedgerWriter
    metrics: Metrics
    auth: AuthCache
    router: ModelRouter
    adapters: EngineAdapters
    store: AdapterStore  # uploaded adapters' files
    admission: Admission
    runs: RunContext
    admin_throttle: AdminAuthThrottle
    scorer: Scorer  # `auto`'s request scorer (settings.router, router_weights)
    not_ready: str | None = "starting"  # why /ready says no; None once started
    _reconciler: asyncio.Task | None = None
    _sweeper: asyncio.Task | None = None

    @classmethod
    def build(cls, settings: Settings, engine: EngineClient, usage: UsageSink | None = None) -> Platform:
        """`usage`: a sink that sees every usage event besides the ledger (tests, benchmarks)."""
        db = make_engine(settings.effective_database_url, connect_timeout_s=settings.db_connect_timeout_s,
                         command_timeout_s=settings.db_command_timeout_s)
        sessions = session_factory(db)
        instance = secrets.token_hex(6)
        tail = Tail()
        quota = Quota(_counters(settings), tail, functools.partial(tenant_usage, db),
                      functools.partial(ledger_ids, db), instance=instance)
        ledger = LedgerWriter(db, Spool(settings.spool_dir, instance), tail, batch_size=settings.ledger_batch_size,
                              flush_interval_s=settings.ledger_flush_interval_s,
                              max_queue=settings.ledger_queue_size)
        metrics = Metrics(engine)
        metrics.watch_billing(ledger, quota)
        admission = Admission(quota, ledger, metrics, fail_open=settings.rate_limit_fail_open,
                              ledger_fail_open=settings.ledger_fail_open)
        sink = FanOutSink(ledger, usage) if usage is not None else ledger
        return cls(
            settings=settings, engine=engine, db=db, sessions=sessions, quota=quota, ledger=ledger, metrics=metrics,
            auth=AuthCache(sessions, settings.auth_cache_ttl_s, outage_grace_s=settings.db_outage_grace_s),
            router=ModelRouter(sessions, settings.catalog_cache_ttl_s, outage_grace_s=settings.db_outage_grace_s),
            adapters=EngineAdapters(engine), admission=admission,
            store=AdapterStore(settings.adapter_store_root, settings.adapter_max_bytes),
            runs=RunContext(engine, admission, metrics, sink, Background(), settings.request_timeout_s),
            admin_throttle=AdminAuthThrottle(settings.admin_auth_max_failures, settings.admin_auth_window_s),
            scorer=load_scorer(settings.router, settings.router_weights))

    def catalog_changed(self) -> None:
        """Called after a write through this instance, so it sees the change at once."""
        self.auth.invalidate()
        self.router.invalidate()

    # Writes that more than the catalog's rows must follow, shared by the admin API and the admin UI.

    async def set_tenant_status(self, name: str, status: str) -> Tenant:
        async with self.sessions() as session:
            tenant = await tenants.set_status(session, name, status)
        self.catalog_changed()
        return tenant

    async def revoke_key(self, prefix: str) -> ApiKey:
        async with self.sessions() as session:
            row = await keys.revoke_key(session, prefix)
        self.catalog_changed()
        return row

    async def set_budget(self, tenant: str, period: str, limit_tokens: int, soft_limit_tokens: int | None = None,
                         key_prefix: str | None = None) -> Budget:
        async with self.sessions() as session:
            row = await budgets.set_budget(session, tenant, period, limit_tokens, soft_limit_tokens, key_prefix)
        self.catalog_changed()  # keys carry their budgets in the auth cache
        return row

    async def delete_budget(self, tenant: str, period: str, key_prefix: str | None = None) -> None:
        async with self.sessions() as session:
            await budgets.delete_budget(session, tenant, period, key_prefix)
        self.catalog_changed()

    async def calibrate_auto(self, window: timedelta, strong_share: float | None = None,
                             shares: dict[str, float] | None = None, apply: bool = True) -> Calibration:
        """Sets auto's thresholds for a traffic share over the window's recorded scores (learned/calibration.py)."""
        async with self.sessions() as session:
            result = await calibration.calibrate_pool(session, window, strong_share, shares, apply)
        if apply:
            self.catalog_changed()
        return result

    async def set_auto_route(self, model: str, auto_max_complexity: float | None) -> Model:
        async with self.sessions() as session:
            row = await catalog.set_auto_route(session, model, auto_max_complexity)
        self.catalog_changed()
        return row

    async def add_price(self, spec: PriceSpec) -> Price:
        """Prices rank `auto`'s models by cost, so the router re-reads them."""
        async with self.sessions() as session:
            price = await set_price(session, spec)
        self.router.invalidate()
        return price

    async def delete_adapter(self, tenant: str, name: str) -> Adapter:
        """New requests for it answer 404 at once (on other instances within the catalog cache's
        lifetime); its running requests finish, then the engine drops it."""
        async with self.sessions() as session:
            row = await catalog.delete_adapter(session, tenant, name)
        self.catalog_changed()
        self.adapters.retire(row.engine_id)
        return row

    def start_billing(self) -> None:
        """The ledger writer (with what stopped processes left in the spool) and the reconciler."""
        self.quota.recover(self.ledger.start())
        self._reconciler = asyncio.create_task(self.quota.run(self.settings.reconcile_interval_s),
                                               name="budget-reconciler")

    def start_adapter_sweeps(self) -> None:
        if self.settings.adapter_sweep_interval_s > 0:
            self._sweeper = asyncio.create_task(
                self.adapters.run_sweeps(self.sessions, self.settings.adapter_sweep_interval_s), name="adapter-sweeper")

    async def flush_usage(self) -> None:
        """Settles what the requests that ended still owe, then writes the ledger's queue."""
        await self.runs.background.drain()
        await self.ledger.flush()

    async def close(self) -> None:
        await self.runs.background.drain()  # settlements and usage of the last requests
        for task in (self._reconciler, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.adapters.drain()  # deleted adapters the engine was still finishing requests of
        await self.ledger.close()
        await self.quota.close()
        await self.db.dispose()


def _counters(settings: Settings) -> CounterStore:
    if settings.redis_url is None:
        return MemoryCounters()
    from loraplex.billing.redis_counters import RedisCounters

    return RedisCounters.from_url(settings.redis_url, settings.redis_prefix, settings.redis_timeout_s,
                                  dead_after_s=settings.dead_process_after_s)


PlatformDep = NamedDependency[Platform]  # how handlers ask Litestar for the app's Platform
