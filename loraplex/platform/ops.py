"""Operations endpoints: /health (the process answers), /ready (it can serve), /metrics (Prometheus).

/metrics is for the operator only: it answers with `Authorization: Bearer $LORAPLEX_ADMIN_TOKEN`
(the admin API's check, throttled per address the same way), 401 in the OpenAI error format without
it, 403 while no admin token is configured. A Prometheus scrape job sends the token with its
`authorization` (credentials_file) setting. Labels name tenants, models and priority classes,
never a key. /metrics/endpoint-picker (with LORAPLEX_PICKER_METRICS on) serves without a token only the
gauges an inference gateway's endpoint picker reads, which name no tenant.
"""

from __future__ import annotations

from litestar import MediaType, Request, Response, get
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from loraplex.platform.admin.api import check_admin_token
from loraplex.platform.errors import PlatformError
from loraplex.platform.metrics import picker_metrics
from loraplex.platform.state import PlatformDep


@get("/health", include_in_schema=False, sync_to_thread=False)
def health() -> dict:
    return {"status": "ok"}


@get("/ready", include_in_schema=False)
async def ready(request: Request, platform: PlatformDep) -> Response:
    """Ready once started (migrations at head, engine models registered) with the database and,
    when configured, Redis reachable; not ready again once the server drains to stop."""
    checks: dict[str, str] = {"startup": platform.not_ready or "ok"}
    drain = request.app.state.get("drain")
    if drain is not None and drain.draining:
        checks["shutdown"] = "draining"
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


def metrics_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """The admin token, or no metrics: they name tenants and show their traffic."""
    if not connection.app.state.platform.settings.admin_token:
        raise PlatformError(403, "/metrics is disabled: set LORAPLEX_ADMIN_TOKEN and scrape with it.",
                            code="admin_disabled")
    scheme, _, given = (connection.headers.get("authorization") or "").partition(" ")
    if not check_admin_token(connection, given if scheme.lower() == "bearer" else ""):
        raise PlatformError(401, "/metrics needs the admin token (Authorization: Bearer $LORAPLEX_ADMIN_TOKEN).",
                            code="invalid_admin_token")


@get("/metrics", include_in_schema=False, guards=[metrics_guard])
async def metrics(platform: PlatformDep) -> Response:
    return Response(platform.metrics.render(), media_type=MediaType.TEXT, headers={"content-type": CONTENT_TYPE_LATEST})


@get("/metrics/endpoint-picker", include_in_schema=False)
async def endpoint_picker_metrics(platform: PlatformDep) -> Response:
    """The four gauges an inference gateway's endpoint picker reads (its scrape sends no credentials), when
    LORAPLEX_PICKER_METRICS is on; they name no tenant. 404 when off."""
    if not platform.settings.picker_metrics:
        raise PlatformError(404, "/metrics/endpoint-picker is off: set LORAPLEX_PICKER_METRICS=1.", code="not_found")
    return Response(picker_metrics(platform.engine.stats()), media_type=MediaType.TEXT,
                    headers={"content-type": CONTENT_TYPE_LATEST})


ops_handlers = [health, ready, metrics, endpoint_picker_metrics]
