"""`loraplex worker`: one engine, served over HTTP to the serving instances in front of it
(`loraplex serve --worker URL`). No tenants, keys or billing here: those stay in `serve`."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

from loraplex.cli.engine_args import add_engine_args, build_engine
from loraplex.cli.listen import add_listen_args, check_port, start_logging
from loraplex.fleet.wire import WORKER_TOKEN_ENV

DEFAULT_PORT = 8100


def add_parser(sub) -> None:
    p = sub.add_parser("worker", help="serve one engine to a fleet (`serve --worker URL`), without tenants or billing")
    add_engine_args(p)
    add_listen_args(p, default_port=DEFAULT_PORT,
                    host_help=f"address to listen on; beyond localhost a worker needs {WORKER_TOKEN_ENV} set")
    p.set_defaults(func=run)


def _loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def run(args: argparse.Namespace) -> int:
    start_logging(args)
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
