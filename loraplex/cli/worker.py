"""`loraplex worker`: one engine, served over HTTP to the serving instances in front of it
(`loraplex serve --worker URL`). No tenants, keys or billing here: those stay in `serve`."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys

from loraplex.cli.engine_args import add_engine_args, build_engine
from loraplex.cli.serve import check_port
from loraplex.fleet.wire import WORKER_TOKEN_ENV

DEFAULT_PORT = 8100


def add_parser(sub) -> None:
    p = sub.add_parser("worker", help="serve one engine to a fleet (`serve --worker URL`), without tenants or billing")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help=f"address to listen on; beyond localhost a worker needs {WORKER_TOKEN_ENV} set")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def _loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = os.environ.get(WORKER_TOKEN_ENV) or None
    if token is None and not _loopback(args.host):
        raise ValueError(f"a worker listening on {args.host} would run anyone's requests: set {WORKER_TOKEN_ENV} "
                         "(and the same on the serving instances), or listen on localhost")
    check_port(args.host, args.port)
    engine = build_engine(args)
    try:
        import uvicorn

        from loraplex.fleet.worker_app import create_worker_app

        app = create_worker_app(engine, token)
        print(f"loraplex worker: serving {', '.join(m.name for m in engine.models())} on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                      access_log=False, lifespan="on")).run()
        return 0
    finally:
        engine.shutdown()
