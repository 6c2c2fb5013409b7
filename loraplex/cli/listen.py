"""What `serve` and `worker` share as servers: where they listen, their logging, and the check that
the address is free before anything slow (a model load, migrations) starts."""

from __future__ import annotations

import argparse
import logging
import socket
import sys


def add_listen_args(p: argparse.ArgumentParser, default_port: int, host_help: str | None = None) -> None:
    p.add_argument("--host", default="127.0.0.1", help=host_help)
    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def start_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def check_port(host: str, port: int) -> None:
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
