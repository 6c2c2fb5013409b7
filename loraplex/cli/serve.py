"""`loraplex serve`: load the model (or several, multiplexed), migrate, serve the API with uvicorn.
With `--ray` it loads no model here: the engine runs as Ray Serve replicas (cli/serve_ray.py,
loraplex/ray_serve).

`--demo` (what `make serve` passes) makes a key for the `demo` tenant and prints it: limited (rate,
tokens per minute, a daily budget, standard priority at most) and expiring after a week; the demo
keys of earlier starts are revoked, so one lives at a time. Without `--demo` no key is made.

SIGTERM (or Ctrl-C) drains before the server stops: /ready answers 503, new generations 503 with
`retry-after`, those in flight finish within `--drain-timeout` (then they are aborted and billed
what they generated), the usage ledger is written, and the process exits 0.

With no configuration everything is embedded: a SQLite file under ./.loraplex/, in-process rate
limit counters, the default model. LORAPLEX_DATABASE_URL / LORAPLEX_REDIS_URL switch to Postgres
and Redis. The CLI builds the engine and hands it to the platform (create_app(settings, engine)).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from datetime import timedelta
from pathlib import Path

from loraplex.cli.engine_args import add_engine_args, build_engine
from loraplex.cli.listen import add_listen_args, check_port, run_server, start_logging
from loraplex.cli.serve_ray import add_ray_args, check_ray_options, ray_options_given
from loraplex.cli.storage import run_db
from loraplex.platform.db.database import session_factory
from loraplex.platform.db.migrate import upgrade
from loraplex.platform.db.tables import utcnow
from loraplex.platform.routing.learned.scorer import load_scorer
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy import budgets, keys, tenants

DEMO_TENANT = DEMO_KEY_NAME = "demo"
DEMO_LIFETIME = timedelta(days=7)
DEMO_LIMITS = {"rpm_limit": 60, "tpm_limit": 50_000}  # a person trying the API, not a workload
DEMO_DAY_TOKENS = 500_000
MAX_DRAIN_S = 24 * 3600
log = logging.getLogger("loraplex.serve")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (embedded SQLite by default)")
    add_engine_args(p)
    add_ray_args(p)
    add_listen_args(p, default_port=8000)
    p.add_argument("--demo", action="store_true",
                   help="make a key for the demo tenant and print it (limited, expires in 7 days; revokes the demo "
                        "keys of earlier starts)")
    # Deprecated: no key is made unless --demo; still accepted (and ignored) so that scripts keep working.
    p.add_argument("--no-demo", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--drain-timeout", type=float, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may take to finish before they are aborted "
                        "(default: LORAPLEX_DRAIN_TIMEOUT, else 30)")
    p.add_argument("--router-weights", metavar="PATH",
                   help="`auto`'s learned scorer weights, from `loraplex router train` (default: "
                        "LORAPLEX_ROUTER_WEIGHTS, else the ones shipped in the package)")
    p.add_argument("--access-log", action="store_true", help="log every request (paths only, never keys)")
    p.set_defaults(func=run)


async def _demo_key(engine) -> str:
    """A new, limited and expiring key for the demo tenant (made if missing); keys are shown once,
    so each start makes one, and revokes the demo keys of the starts before."""
    async with session_factory(engine)() as session:
        if await tenants.find_tenant(session, DEMO_TENANT) is None:
            await tenants.create_tenant(session, DEMO_TENANT, tier="demo")
        for old in await keys.list_keys(session, DEMO_TENANT):
            if old.name == DEMO_KEY_NAME and old.revoked_at is None:
                await keys.revoke_key(session, old.prefix)
        spec = keys.KeySpec(name=DEMO_KEY_NAME, expires_at=utcnow() + DEMO_LIFETIME, max_priority="standard",
                            **DEMO_LIMITS)
        row, secret = await keys.create_key(session, DEMO_TENANT, spec)
        await budgets.set_budget(session, DEMO_TENANT, "day", DEMO_DAY_TOKENS, key_prefix=row.prefix)
    return secret


def run(args: argparse.Namespace) -> int:
    start_logging(args)
    settings = Settings.from_env()
    if args.router_weights:
        settings = dataclasses.replace(settings, router="learned", router_weights=Path(args.router_weights))
    load_scorer(settings.router, settings.router_weights)  # a bad weights file fails now, before the engine loads
    args.drain_timeout = settings.drain_timeout_s if args.drain_timeout is None else args.drain_timeout
    if not 0 <= args.drain_timeout <= MAX_DRAIN_S:
        raise ValueError(f"--drain-timeout (or LORAPLEX_DRAIN_TIMEOUT) must be in 0..{MAX_DRAIN_S} seconds, "
                         f"got {args.drain_timeout}")
    if not args.ray and ray_options_given(args):
        raise ValueError(f"{', '.join(ray_options_given(args))}: these size the Ray Serve replicas; give --ray too")
    if args.ray:
        check_ray_options(args)
    check_port(args.host, args.port)
    if args.ray:
        from loraplex.cli.serve_ray import ray_engine

        client, plugins = ray_engine(args)
        run_db(upgrade, settings, create=True)
        return _serve(args, settings, client, plugins)
    engine = build_engine(args)  # bad engine options fail here, in one line, before the database is touched
    try:
        run_db(upgrade, settings, create=True)
        from loraplex.engine.compute import local_compute_path

        log.info("%s", local_compute_path(args.device or "auto").summary())
        return _serve(args, settings, engine, [])
    finally:
        engine.shutdown()


def _serve(args: argparse.Namespace, settings: Settings, engine, plugins: list) -> int:
    import uvicorn

    from loraplex.admin_ui import AdminUI
    from loraplex.platform.app import create_app

    app = create_app(settings, engine, plugins=[AdminUI(), *plugins])
    if args.demo:
        print(f"demo api key: {run_db(_demo_key, settings)}", flush=True)
    served = ", ".join(m.name for m in engine.models())
    log.info("serving %s on http://%s:%d/v1 (admin UI: /admin%s)", served, args.host, args.port,
             "" if settings.admin_token else ", off until LORAPLEX_ADMIN_TOKEN is set")
    timeout_s = args.drain_timeout

    async def drain() -> None:
        """Answers 503 to new generations, waits for those in flight, then writes the usage ledger."""
        log.info("draining: %d requests in flight, waiting up to %g s", app.state.drain.in_flight, timeout_s)
        aborted = await app.state.drain.run(timeout_s)
        if aborted:
            log.warning("drain timeout: %d requests aborted (billed what they generated)", aborted)
        await app.state.platform.flush_usage()

    # After the drain nothing generates any more; what else is in flight gets a few seconds.
    # log_config None: uvicorn's loggers hand their records to ours (cli/logs.py), one format for all
    run_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                              access_log=args.access_log, lifespan="on", timeout_graceful_shutdown=5), drain)
    return 0
