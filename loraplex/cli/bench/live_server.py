"""A real `loraplex serve` process on loopback over a scratch Postgres database and Redis prefix,
for the benchmarks that must meet the server as a client does (fuzz, soak): started, driven through
its admin API, measured (RSS, ledger rows) and stopped; the database and counters are dropped after.
"""

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
REDIS = "redis://localhost:6379/0"


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """The server process, its URL, admin token and database (for counting ledger rows)."""

    proc: subprocess.Popen
    base_url: str
    admin_token: str
    database_url: str
    output: list[str] = field(default_factory=list)  # its last KEEP_LINES lines
    lines: queue.Queue = field(default_factory=queue.Queue)
    dropped: int = 0  # lines no longer kept in `output`

    KEEP_LINES = 50_000

    def read_output(self) -> list[str]:
        """What the process printed lately (its last KEEP_LINES lines, so a long run stays bounded)."""
        while not self.lines.empty():
            self.output.append(self.lines.get())
        if len(self.output) > self.KEEP_LINES:
            cut = len(self.output) - self.KEEP_LINES // 2
            self.dropped += cut
            del self.output[:cut]
        return self.output

    def output_since(self, mark: int) -> tuple[list[str], int]:
        """The lines printed after line number `mark` (0: the first), and the mark to pass next time."""
        lines = self.read_output()
        return lines[max(0, mark - self.dropped):], self.dropped + len(lines)

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        """An admin API call that must succeed."""
        r = httpx.request(method, f"{self.base_url}/admin/api{path}", timeout=60,
                          headers={"authorization": f"Bearer {self.admin_token}"}, **kwargs)
        if r.status_code >= 300:
            raise RuntimeError(f"admin {method} {path}: {r.status_code} {r.text[:500]}")
        return r

    def rss_bytes(self) -> int:
        """The server process's resident set size now (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def ledger_request_ids(self) -> set[str]:
        """The request ids of every usage row the server wrote to its database."""
        return asyncio.run(_ledger_ids(self.database_url))

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 30 s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


async def _ledger_ids(url: str) -> set[str]:
    """The request ids in the usage ledger of the database at `url`."""
    from sqlalchemy import select

    from loraplex.billing.tables import usage_ledger
    from loraplex.platform.db.database import make_engine

    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            return {row[0] for row in await conn.execute(select(usage_ledger.c.request_id))}
    finally:
        await engine.dispose()


async def delete_redis_prefix(url: str, prefix: str) -> None:
    """Deletes the server's Redis keys (all under `prefix`)."""
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    try:
        names = [k async for k in client.scan_iter(match=f"{prefix}*")]
        if names:
            await client.delete(*names)
    finally:
        await client.aclose()


@contextlib.contextmanager
def live_server(serve_args: list[str], *, database_server: str = PG_SERVER, redis_url: str = REDIS,
                env: dict | None = None, timeout_s: float = 300) -> Iterator[LiveServer]:
    """`loraplex serve <serve_args> --host 127.0.0.1 --port <free>` on a scratch database; yields once
    /ready answers 200; stops the process and drops the database and Redis keys after."""
    from loraplex.platform.db.provision import create_database, drop_database

    token = secrets.token_urlsafe(24)
    prefix = f"loraplex-bench-{secrets.token_hex(4)}:"
    db = asyncio.run(create_database(database_server, prefix="loraplex_bench_"))
    data_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"loraplex-bench-{secrets.token_hex(4)}"
    port = free_port()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORAPLEX_DATABASE_URL": db, "LORAPLEX_REDIS_URL": redis_url,
                "LORAPLEX_REDIS_PREFIX": prefix, "LORAPLEX_ADMIN_TOKEN": token, "LORAPLEX_DATA_DIR": str(data_dir),
                **(env or {})}
    cmd = [sys.executable, "-m", "loraplex.cli.main", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    server = LiveServer(proc, f"http://127.0.0.1:{port}", token, db)
    threading.Thread(target=lambda: [server.lines.put(line.rstrip("\n")) for line in proc.stdout],
                     daemon=True).start()
    try:
        _wait_ready(server, timeout_s)
        yield server
    finally:
        server.stop()
        server.read_output()
        asyncio.run(drop_database(db))
        asyncio.run(delete_redis_prefix(redis_url, prefix))
        subprocess.run(["rm", "-rf", str(data_dir)], check=False)


def _wait_ready(server: LiveServer, timeout_s: float) -> None:
    """Returns once /ready answers 200; raises with the server's output if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.read_output()
        if server.proc.poll() is not None:
            raise RuntimeError("server exited:\n" + "\n".join(server.output[-50:]))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("server not ready in time:\n" + "\n".join(server.output[-50:]))
