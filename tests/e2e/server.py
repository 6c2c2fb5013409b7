"""Starts the real `loraplex serve` process for e2e tests and waits until it is ready."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PG_SERVER = "postgresql://postgres@localhost:5432/postgres"


@contextlib.contextmanager
def postgres_redis_env(data_dir: Path, admin_token: str) -> Iterator[dict]:
    """A server's environment on a scratch Postgres database and Redis prefix, both dropped after."""
    from loraplex.platform.db.provision import create_database, drop_database
    from tests.integration.conftest import delete_redis_prefix

    pg = os.environ.get("LORAPLEX_TEST_DATABASE_URL", PG_SERVER)
    redis = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://localhost:6379/0")
    db = asyncio.run(create_database(pg, prefix="loraplex_test_e2e_"))
    env = {"LORAPLEX_DATABASE_URL": db, "LORAPLEX_REDIS_URL": redis, "LORAPLEX_ADMIN_TOKEN": admin_token,
           "LORAPLEX_REDIS_PREFIX": f"loraplex-test-e2e-{secrets.token_hex(4)}:", "LORAPLEX_DATA_DIR": str(data_dir)}
    try:
        yield env
    finally:
        asyncio.run(drop_database(db))
        asyncio.run(delete_redis_prefix(redis, env["LORAPLEX_REDIS_PREFIX"]))


def admin_request(server: Server, token: str, method: str, path: str, **kwargs) -> httpx.Response:
    """A call to the admin API that must succeed."""
    r = httpx.request(method, f"{server.base_url}/admin/api{path}", headers={"authorization": f"Bearer {token}"},
                      timeout=30, **kwargs)
    assert r.status_code < 300, r.text
    return r


def tenant_key(server: Server, token: str, prefix: str) -> str:
    """A new tenant named `prefix-<random>` and a key of it (the secret)."""
    tenant = f"{prefix}-{secrets.token_hex(4)}"
    admin_request(server, token, "POST", "/tenants", json={"name": tenant})
    return admin_request(server, token, "POST", f"/tenants/{tenant}/keys", json={}).json()["key"]


@contextlib.contextmanager
def serving(data_dir: Path, admin_token: str, env: dict | None = None, args: tuple[str, ...] = ()) -> Iterator[Server]:
    """`start` over scratch Postgres and Redis (postgres_redis_env) with `env` added and `serve` options `args`;
    stopped after."""
    with postgres_redis_env(data_dir, admin_token) as base:
        server = start({**base, **(env or {})}, *args)
        try:
            yield server
        finally:
            server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    stdout: list[str] = field(default_factory=list)

    @property
    def demo_keys(self) -> list[str]:
        return [line.split(": ", 1)[1] for line in self.stdout if line.startswith("demo api key: ")]

    def stop(self) -> None:
        """SIGTERM, which drains (requests in flight get the drain timeout, 30 s by default), then exit."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(env: dict, *args: str, timeout_s: float = 120) -> Server:
    """`python -m loraplex.cli.main serve --model synthetic:tiny --port <free>` with `env` added;
    returns once /ready answers 200 (or fails with the process's output)."""
    model = ("--model", "synthetic:tiny", "--device", "cpu", "--kv-cache-mb", "16")
    return _launch(["serve", *model, *args], "/ready", env, timeout_s)


def _launch(command: list[str], ready_path: str, env: dict, timeout_s: float) -> Server:
    port = free_port()
    if "--port" in command:
        port = int(command[command.index("--port") + 1])
    else:
        command = [*command, "--port", str(port)]
    cmd = [sys.executable, "-m", "loraplex.cli.main", *command]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    server = Server(proc, f"http://127.0.0.1:{port}")
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        while not lines.empty():
            server.stdout.append(lines.get())
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + "\n".join(server.stdout))
        try:
            if httpx.get(f"{server.base_url}{ready_path}", timeout=2).status_code == 200:
                time.sleep(0.1)
                while not lines.empty():
                    server.stdout.append(lines.get())
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("server not ready in time:\n" + "\n".join(server.stdout))
