"""create_app(settings, engine): the Litestar app over an engine it is given.

The caller owns the engine (the CLI builds an AsyncEngine; tests and benchmarks pass their own),
so the platform imports nothing from the engine but its api module.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Sequence

from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.middleware import DefineMiddleware
from litestar.plugins import PluginProtocol
from sqlalchemy.exc import DBAPIError, IntegrityError

from loraplex.billing.usage import UsageSink
from loraplex.engine.api import EngineClient
from loraplex.platform.admin.api import admin_router
from loraplex.platform.admin.billing_api import admin_billing_router
from loraplex.platform.auth_throttle import AuthThrottle, FailedAuthLimit
from loraplex.platform.db.migrate import current_revision, head_revision
from loraplex.platform.errors import PlatformError, handle_exception
from loraplex.platform.middleware import Drain, response_hook
from loraplex.platform.openai.handlers import openai_router
from loraplex.platform.ops import ops_handlers
from loraplex.platform.schema_page import openapi_config
from loraplex.platform.settings import Settings
from loraplex.platform.state import Platform
from loraplex.platform.tenancy.catalog import ensure_model

log = logging.getLogger("loraplex.platform")


def create_app(settings: Settings | None = None, engine: EngineClient | None = None, *,
               usage_sink: UsageSink | None = None, plugins: Sequence[PluginProtocol] = ()) -> Litestar:
    """settings None: read LORAPLEX_* from the environment now. The engine is required. Usage
    goes to the ledger; `usage_sink` also gets every event (tests, benchmarks). `plugins`: what is
    mounted beside the APIs, such as the admin UI (which imports the platform, so it is handed in)."""
    if engine is None:
        raise ValueError("create_app needs an engine (an EngineClient); `loraplex serve` builds one")
    settings = settings or Settings.from_env()
    platform = Platform.build(settings, engine, usage_sink)
    tenant_auth = AuthThrottle(settings.auth_max_failures, settings.auth_failure_window_s,
                               what="failed authentications")
    drain = Drain()  # `serve` runs it on SIGTERM (app.state.drain)

    async def startup() -> None:
        platform.start_billing()
        platform.start_adapter_sweeps()
        platform.not_ready = await _start(platform)
        _freeze_heap()

    async def shutdown() -> None:
        await platform.close()
        gc.unfreeze()

    return Litestar(
        route_handlers=[openai_router, admin_router, admin_billing_router, *ops_handlers],
        dependencies={"platform": Provide(lambda: platform, sync_to_thread=False)},
        state=State({"platform": platform, "drain": drain}),
        # Everything leaves in the OpenAI error shape. The tenant's or admin's input that reaches a
        # library unchecked (errors.BAD_INPUT_ERRORS: ValueError, OverflowError, RecursionError) is
        # a 400 without a traceback or an echo of the input (errors.bad_input), never a 500. One
        # handler for Exception, so a mounted plugin's own (the admin UI's pages) still wins there.
        exception_handlers={Exception: handle_exception},
        # Bodies beyond the limit answer 413 before they are parsed; the adapter blob upload
        # (adapter_store_api.py) has its own, the store's byte limit.
        request_max_body_size=settings.max_body_bytes,
        middleware=[drain.middleware, DefineMiddleware(FailedAuthLimit, throttle=tenant_auth)],
        before_send=[response_hook(platform.metrics)],
        on_startup=[startup], on_shutdown=[shutdown],
        plugins=list(plugins),
        openapi_config=openapi_config(),  # the JSON and a page of our own: nothing loads from a CDN
        logging_config=None,  # the process's logging is set up once, by what runs the app (`serve`: cli/logs.py)
    )


async def _start(platform: Platform) -> str | None:
    """Checks the schema and registers the engine's models; returns why the app is not ready, or None."""
    try:
        current, head = await current_revision(platform.db), head_revision()
        if current != head:
            return f"database schema at {current or 'nothing'}, expected {head}: run `loraplex db upgrade`"
        for info in platform.engine.models():
            async with platform.sessions() as session:
                with contextlib.suppress(IntegrityError, PlatformError):  # another instance was first
                    await ensure_model(session, info.name)
    except (DBAPIError, OSError) as exc:
        log.error("database unreachable at startup: %s", type(exc).__name__)
        return "database unreachable"
    return None


def _freeze_heap() -> None:
    """Moves what start-up made (modules, the app, the engine's objects) out of the garbage
    collector's sight: a full collection otherwise walks all of it, a pause of tens of ms (far
    more with a model loaded) that lands on whichever requests are in flight. What is frozen is
    never collected, so garbage is collected first; shutdown unfreezes it (tests make many apps)."""
    gc.collect()
    gc.freeze()
