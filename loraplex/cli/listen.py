"""What `serve` and `worker` share as servers: where they listen, their logging, the check that
the address is free before anything slow (a model load, migrations) starts, and a uvicorn server
that drains before it stops."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable


def add_listen_args(p: argparse.ArgumentParser, default_port: int, host_help: str | None = None) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help=host_help or "the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=default_port, help=f"the TCP port (default {default_port})")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the least severe log records shown (default info)")


def start_logging(args: argparse.Namespace) -> None:
    """One handler and format for every logger (cli/logs.py; LORAPLEX_LOG_FORMAT)."""
    from loraplex.cli.logs import configure_logging

    configure_logging(args.log_level)


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


def run_server(config, drain: Callable[[], Awaitable[object]]) -> None:
    """`uvicorn.Server(config).run()`, except that the first SIGTERM (or Ctrl-C) runs `drain` while
    the server still listens, then stops it, and the process exits normally (status 0). uvicorn on
    its own closes the listener at once, so /ready could not say "draining" nor a new request get
    its 503 while the requests in flight finish. A second signal hands over to uvicorn's own stop
    (what is in flight gets the config's timeout_graceful_shutdown, and the signal its default action)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server with the first signal turned into a drain."""

        drain_asked = False

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig: int, frame) -> None:
            if self.drain_asked or self.should_exit or not self.started:
                super().handle_exit(sig, frame)
                return
            self.drain_asked = True  # (a signal handler: the loop is told, the work runs there)
            self.loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self.drain_task = self.loop.create_task(self._drain(), name="drain")  # (held: tasks are weakly kept)

        async def _drain(self) -> None:
            try:
                await drain()
            except Exception:  # stop anyway; the lifespan shutdown still writes what it can
                logging.getLogger("loraplex").exception("drain failed")
            self.should_exit = True

    DrainingServer(config).run()
