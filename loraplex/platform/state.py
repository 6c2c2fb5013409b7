"""The services one app instance holds, built from settings and handed to every handler."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.di import NamedDependency
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from loraplex.billing.ratelimit import MemoryRateLimiter, RateLimiter
from loraplex.billing.usage import LogUsageSink, UsageSink
from loraplex.engine.api import EngineClient
from loraplex.platform.admission import Admission
from loraplex.platform.auth import AuthCache
from loraplex.platform.db.database import make_engine, session_factory
from loraplex.platform.generation import RunContext
from loraplex.platform.metrics import Metrics
from loraplex.platform.routing import EngineAdapters, ModelRouter
from loraplex.platform.settings import Settings


@dataclass
class Platform:
    settings: Settings
    engine: EngineClient
    db: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    limiter: RateLimiter
    metrics: Metrics
    auth: AuthCache
    router: ModelRouter
    adapters: EngineAdapters
    admission: Admission
    runs: RunContext
    not_ready: str | None = "starting"  # why /ready says no; None once started

    @classmethod
    def build(cls, settings: Settings, engine: EngineClient, usage: UsageSink | None = None) -> Platform:
        db = make_engine(settings.effective_database_url)
        sessions = session_factory(db)
        limiter = _limiter(settings)
        metrics = Metrics(engine)
        admission = Admission(limiter, metrics, fail_open=settings.rate_limit_fail_open)
        return cls(
            settings=settings, engine=engine, db=db, sessions=sessions, limiter=limiter, metrics=metrics,
            auth=AuthCache(sessions, settings.auth_cache_ttl_s),
            router=ModelRouter(sessions, settings.catalog_cache_ttl_s),
            adapters=EngineAdapters(engine), admission=admission,
            runs=RunContext(engine, admission, metrics, usage or LogUsageSink()))

    def catalog_changed(self) -> None:
        """Called after a write through this instance, so it sees the change at once."""
        self.auth.invalidate()
        self.router.invalidate()

    async def close(self) -> None:
        await self.limiter.close()
        await self.db.dispose()


def _limiter(settings: Settings) -> RateLimiter:
    if settings.redis_url is None:
        return MemoryRateLimiter()
    from loraplex.billing.redis_ratelimit import RedisRateLimiter

    return RedisRateLimiter.from_url(settings.redis_url, settings.redis_prefix, settings.redis_timeout_s)


PlatformDep = NamedDependency[Platform]  # how handlers ask Litestar for the app's Platform
