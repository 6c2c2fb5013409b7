"""`loraplex serve`: migrate, load the model (or several, multiplexed), make a demo key, serve the
API with uvicorn. With `--worker URL`s it loads no model: requests go to those engine workers
(`loraplex worker`), placed by adapter affinity (loraplex/fleet).

With no configuration everything is embedded: a SQLite file under ./.loraplex/, in-process rate
limit counters, the default model. LORAPLEX_DATABASE_URL / LORAPLEX_REDIS_URL switch to Postgres
and Redis. The CLI builds the engine and hands it to the platform (create_app(settings, engine)).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from loraplex.cli.engine_args import add_engine_args, build_engine, given_engine_options
from loraplex.cli.listen import add_listen_args, check_port, start_logging
from loraplex.cli.storage import run_db
from loraplex.fleet.placement import POLICIES
from loraplex.platform.db.database import session_factory
from loraplex.platform.db.migrate import upgrade
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy import keys, tenants

DEMO_TENANT = "demo"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (embedded SQLite by default)")
    add_engine_args(p)
    fleet = p.add_argument_group("fleet (instead of an engine in this process)")
    fleet.add_argument("--worker", action="append", metavar="URL",
                       help="an engine worker (`loraplex worker`) to send requests to; repeat it for several. The "
                            "workers serve the models, so no engine option may be given with it. Calls carry "
                            "LORAPLEX_WORKER_TOKEN when it is set")
    fleet.add_argument("--placement", choices=POLICIES, default="affinity",
                       help="how requests are spread over the workers: affinity (default) keeps each adapter's "
                            "requests on its own worker within a load bound; least_loaded ignores adapters")
    add_listen_args(p, default_port=8000)
    p.add_argument("--no-demo", action="store_true", help="do not create the demo tenant and key")
    p.add_argument("--access-log", action="store_true", help="log every request (paths only, never keys)")
    p.set_defaults(func=run)


async def _demo_key(engine) -> str:
    """A new key for the demo tenant (made if missing): keys are shown once, so each start makes one."""
    async with session_factory(engine)() as session:
        if await tenants.find_tenant(session, DEMO_TENANT) is None:
            await tenants.create_tenant(session, DEMO_TENANT, tier="demo")
        _, secret = await keys.create_key(session, DEMO_TENANT, keys.KeySpec(name="demo", max_priority="realtime"))
    return secret


def run(args: argparse.Namespace) -> int:
    start_logging(args)
    settings = Settings.from_env()
    if args.worker and given_engine_options(args):
        raise ValueError(f"{', '.join(given_engine_options(args))}: with --worker the workers run the engine; "
                         "give engine options to `loraplex worker`")
    check_port(args.host, args.port)
    if args.worker:
        from loraplex.fleet.fleet import EngineFleet
        from loraplex.fleet.lifecycle import FleetLifecycle
        from loraplex.fleet.remote import RemoteWorker
        from loraplex.fleet.wire import WORKER_TOKEN_ENV

        fleet = EngineFleet([RemoteWorker(url, os.environ.get(WORKER_TOKEN_ENV)) for url in args.worker],
                            policy=args.placement)
        fleet.connect()  # fails in one line when no worker answers
        logging.getLogger("httpx").setLevel(logging.WARNING)  # (not a line per health poll)
        run_db(upgrade, settings)
        return _serve(args, settings, fleet, [FleetLifecycle(fleet)])
    run_db(upgrade, settings)
    engine = build_engine(args)
    try:
        return _serve(args, settings, engine, [])
    finally:
        engine.shutdown()


def _serve(args: argparse.Namespace, settings: Settings, engine, plugins: list) -> int:
    import uvicorn

    from loraplex.admin_ui import AdminUI
    from loraplex.platform.app import create_app

    app = create_app(settings, engine, plugins=[AdminUI(), *plugins])
    if not args.no_demo:
        print(f"demo api key: {run_db(_demo_key, settings)}", flush=True)
    served = ", ".join(m.name for m in engine.models())
    print(f"loraplex: serving {served} on http://{args.host}:{args.port}/v1 "
          f"(admin UI: /admin{'' if settings.admin_token else ', off until LORAPLEX_ADMIN_TOKEN is set'})",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=args.access_log, lifespan="on"))
    server.run()
    return 0
