"""`loraplex serve`: migrate, load the model (or several, multiplexed), make a demo key, serve the
API with uvicorn.

With no configuration everything is embedded: a SQLite file under ./.loraplex/, in-process rate
limit counters, the default model. LORAPLEX_DATABASE_URL / LORAPLEX_REDIS_URL switch to Postgres
and Redis. The CLI builds the engine and hands it to the platform (create_app(settings, engine)).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from loraplex.cli.storage import run_db
from loraplex.platform.db.database import session_factory
from loraplex.platform.db.migrate import upgrade
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy import keys, tenants

DEMO_TENANT = "demo"
DEFAULT_MODEL = "smollm2-135m"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (embedded SQLite by default)")
    p.add_argument("--model", action="append", metavar="MODEL",
                   help=f"a base model to serve; repeat it to serve several, multiplexed under --memory-budget-mb, "
                        f"the first loaded at start and the default (default {DEFAULT_MODEL})")
    p.add_argument("--memory-budget-mb", type=int,
                   help="with several models: device memory for their weights, KV caches and adapter slots together "
                        "(default 80%% of the device's); idle models are evicted, least recently used first")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV cache size in MiB")
    p.add_argument("--speculative-tokens", type=int,
                   help="n-gram speculative decoding: draft tokens per request and step, while at most 8 run "
                        "(0: off; default: the engine's, 4)")
    p.add_argument("--no-demo", action="store_true", help="do not create the demo tenant and key")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every request (paths only, never keys)")
    p.set_defaults(func=run)


def _check_port(host: str, port: int) -> None:
    """Fails before the model loads if the address is taken."""
    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(infos[0][4])
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


async def _demo_key(engine) -> str:
    """A new key for the demo tenant (made if missing): keys are shown once, so each start makes one."""
    async with session_factory(engine)() as session:
        if await tenants.find_tenant(session, DEMO_TENANT) is None:
            await tenants.create_tenant(session, DEMO_TENANT, tier="demo")
        _, secret = await keys.create_key(session, DEMO_TENANT, keys.KeySpec(name="demo", max_priority="realtime"))
    return secret


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    from loraplex.engine.config import EngineConfig

    args.model = args.model or [DEFAULT_MODEL]
    if len(set(args.model)) != len(args.model):
        raise ValueError(f"--model names a model twice: {', '.join(args.model)}")
    if args.memory_budget_mb is not None and args.memory_budget_mb <= 0:
        raise ValueError(f"--memory-budget-mb must be positive, got {args.memory_budget_mb}")
    config = EngineConfig(model=args.model[0], device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                          kv_cache_bytes=args.kv_cache_mb * 1024 * 1024,
                          **_speculation(args))
    _check_port(args.host, args.port)
    run_db(upgrade, settings)
    from loraplex.engine.models.loader import resolve_model

    for name in args.model:
        resolve_model(name)  # an unknown model name fails here, in one line
    engine = _engine(args, config)
    try:
        return _serve(args, settings, engine)
    finally:
        engine.shutdown()


def _speculation(args: argparse.Namespace) -> dict:
    """--speculative-tokens when given; else the engine's default."""
    return {} if args.speculative_tokens is None else {"speculative_tokens": args.speculative_tokens}


def _engine(args: argparse.Namespace, config):
    """One model: its engine, loaded now. Several: a pool that multiplexes them under the memory
    budget, the first one loaded now and the others on their first request."""
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.pool import ModelPool

    if len(args.model) == 1 and args.memory_budget_mb is None:
        return AsyncEngine.from_config(config)
    budget = args.memory_budget_mb * 2**20 if args.memory_budget_mb is not None else 0.8
    pool = ModelPool(memory_budget=budget, device=args.device)
    try:
        for name in args.model:
            pool.register_model(name, config=config)
        pool.load(args.model[0])
    except BaseException:
        pool.shutdown()
        raise
    return AsyncEngine(pool)


def _serve(args: argparse.Namespace, settings: Settings, engine) -> int:
    import uvicorn

    from loraplex.admin_ui import AdminUI
    from loraplex.platform.app import create_app

    app = create_app(settings, engine, plugins=[AdminUI()])
    if not args.no_demo:
        print(f"demo api key: {run_db(_demo_key, settings)}", flush=True)
    print(f"loraplex: serving {', '.join(args.model)} on http://{args.host}:{args.port}/v1 "
          f"(admin UI: /admin{'' if settings.admin_token else ', off until LORAPLEX_ADMIN_TOKEN is set'})",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=args.access_log, lifespan="on"))
    server.run()
    return 0
