"""Operations endpoints: /health (the process answers), /ready (it can serve), /metrics (Prometheus)."""

from __future__ import annotations

from litestar import MediaType, Response, get
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from loraplex.platform.state import PlatformDep


@get("/health", include_in_schema=False, sync_to_thread=False)
def health() -> dict:
    return {"status": "ok"}


@get("/ready", include_in_schema=False)
async def ready(platform: PlatformDep) -> Response:
    """Ready once started (migrations at head, engine models registered) with the database and,
    when configured, Redis reachable."""
    checks: dict[str, str] = {"startup": platform.not_ready or "ok"}
    try:
        async with platform.db.connect() as conn:
            await conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # any failure means not ready; the body says which part
        checks["database"] = f"unreachable: {type(exc).__name__}"
    if platform.settings.redis_url is not None:
        checks["redis"] = "ok" if await platform.quota.store.ping() else "unreachable"
    checks["models"] = ", ".join(m.name for m in platform.engine.models()) or "none loaded"
    ok = all(v == "ok" for k, v in checks.items() if k != "models") and bool(platform.engine.models())
    return Response({"status": "ready" if ok else "not ready", "checks": checks}, status_code=200 if ok else 503)


@get("/metrics", include_in_schema=False)
async def metrics(platform: PlatformDep) -> Response:
    return Response(platform.metrics.render(), media_type=MediaType.TEXT, headers={"content-type": CONTENT_TYPE_LATEST})


ops_handlers = [health, ready, metrics]
