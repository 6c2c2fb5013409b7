"""`loraplex bench gateway`: what the platform adds to a request, over an engine that costs nothing.

- The fake engine answers every request with a fixed number of tokens at once, so what is measured is the whole
  request path (HTTP, auth, model resolution, rate limits in Redis, usage emission, metrics, JSON), not the model.
- The same engine is also called directly, in the same run and at the same open-loop rate; the difference of the
  latency percentiles is the added latency.
- The gateway runs as one uvicorn worker in its own process (one core); the load generator is a plain keep-alive
  HTTP/1.1 client on the other core, so its own cost stays small.
- The gateway process's CPU time per request during the max_rps run is reported too: on a shared machine it moves
  far less from run to run than the latencies do.
- `--auto` also measures, against the same gateway process, requests for `model: "auto"` over a pool of three models
  (limits 0.3, 0.6 and 1): what scoring the request and preparing (tokenizing) its prompt for each model costs,
  reported beside the named model's figures and as their ratio.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import platform as pyplatform
import secrets
import socket
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

from loraplex.cli.bench.percentiles import percentile
from loraplex.engine.api import EngineStats, GenerateEvent, GenerateRequest, KVCacheStats, ModelInfo, Usage

MODEL = "bench-model"
AUTO_POOL = {MODEL: 1.0, f"{MODEL}-small": 0.3, f"{MODEL}-medium": 0.6}  # name -> auto_max_complexity


class FixedEngine:
    """An EngineClient that returns `tokens` tokens in one event, without computing anything."""

    def __init__(self, tokens: int = 16, models: tuple[str, ...] = (MODEL,)):
        self.tokens = tokens
        self._models = [ModelInfo(name, 4096, 32000) for name in models]
        self._ids = tuple(range(100, 100 + tokens))
        self._text = "x" * tokens

    def models(self) -> list[ModelInfo]:
        return self._models

    @staticmethod
    def _prompt_tokens(request: GenerateRequest) -> int:
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        if request.messages is not None:
            return sum(len(str(m.get("content", ""))) for m in request.messages) // 4 + 8
        return len(request.prompt or "") // 4 + 1

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        """The request with a made-up token id per 4 characters of its prompt, as an engine's would be."""
        ids = (1,) * self._prompt_tokens(request)
        return dataclasses.replace(request, prompt=None, messages=None, prompt_token_ids=ids)

    async def _events(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        n = min(self.tokens, request.sampling.max_tokens or self.tokens)
        usage = Usage(self._prompt_tokens(request), n, 0, 0.0)
        yield GenerateEvent(request.request_id, self._text[:n], self._ids[:n], "length", usage)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        return self._events(request)

    async def abort(self, request_id: str) -> None:
        return None

    def add_adapter(self, adapter_id: str, path: str, base_model: str | None = None) -> None:
        return None

    def has_adapter(self, adapter_id: str, base_model: str | None = None) -> bool:
        return False

    async def remove_adapter(self, adapter_id: str, base_model: str | None = None) -> None:
        return None

    def replicas(self) -> list:
        return []

    def compute_path(self) -> None:
        return None  # (no model runs)

    def stats(self) -> EngineStats:
        return EngineStats(kv=KVCacheStats(blocks_total=1, blocks_free=1))


# --- the gateway process -------------------------------------------------------------------------


def _serve(settings, port: int, tokens: int, models: tuple[str, ...]) -> None:
    import uvicorn

    from loraplex.platform.app import create_app

    app = create_app(settings, FixedEngine(tokens, models))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, timeout_keep_alive=60)


async def _prepare(settings, models: tuple[str, ...]) -> str:
    """Migrates the scratch database, makes a tenant, a key with (high) limits and the models (with
    more than one, all in auto's pool)."""
    from loraplex.platform.db.database import make_engine, session_factory
    from loraplex.platform.db.migrate import upgrade
    from loraplex.platform.tenancy import catalog, keys, tenants

    engine = make_engine(settings.effective_database_url)
    try:
        await upgrade(engine)
        async with session_factory(engine)() as session:
            for name in models:
                await catalog.ensure_model(session, name)
                if len(models) > 1:
                    await catalog.set_auto_route(session, name, AUTO_POOL[name])
            await tenants.create_tenant(session, "bench")
            spec = keys.KeySpec(name="bench", rpm_limit=10_000_000, tpm_limit=1_000_000_000)
            _, secret = await keys.create_key(session, "bench", spec)
    finally:
        await engine.dispose()
    return secret


# --- the load generator --------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection that sends the same POST and reads whole responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes):
        self.reader, self.writer, self.request = reader, writer, request

    @classmethod
    async def open(cls, port: int, request: bytes) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, request)

    async def send(self) -> int:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(int(v) for k, _, v in (x.partition(b":") for x in lines[1:]) if k.lower() == b"content-length")
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


def _request_bytes(key: str, port: int, tokens: int, model: str) -> bytes:
    body = json.dumps({"model": model, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "Say something short about the sea."}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _open_loop(call, rate: float, count: int) -> tuple[list[float], int]:
    """Starts `count` calls at `rate`/s on schedule; latency counts from the scheduled start, so a
    stalled server cannot hide its queueing (no coordinated omission)."""
    latencies: list[float] = []
    failures = 0
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05

    async def one(at: float) -> None:
        nonlocal failures
        ok = await call()
        latencies.append(loop.time() - at)
        failures += not ok

    tasks = []
    for i in range(count):
        at = start + i / rate
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(at)))
    await asyncio.gather(*tasks)
    return latencies, failures


class Pool:
    """Connections handed out one request at a time; a new one opens when all are busy."""

    def __init__(self, port: int, request: bytes):
        self.port, self.request = port, request
        self.idle: list[Connection] = []
        self.opened = 0

    async def call(self) -> bool:
        conn = self.idle.pop() if self.idle else await self._open()
        try:
            status = await conn.send()
        except (asyncio.IncompleteReadError, ConnectionError):  # the server closed an idle connection
            conn.close()
            conn = await self._open()
            status = await conn.send()
        self.idle.append(conn)
        return status == 200

    async def _open(self) -> Connection:
        self.opened += 1
        return await Connection.open(self.port, self.request)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()


async def _closed_loop(pool: Pool, concurrency: int, seconds: float) -> tuple[float, int, int]:
    """(requests/s, failures, requests) with `concurrency` connections sending back to back."""
    done = failures = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, failures
        while time.perf_counter() < stop:
            ok = await pool.call()
            done += 1
            failures += not ok

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - began), failures, done


def _percentiles(values: list[float]) -> dict[str, float]:
    pick = {q: round(percentile(values, q) * 1000, 3) for q in (50, 90, 99)}
    return {"p50": pick[50], "p90": pick[90], "p99": pick[99], "mean": round(statistics.fmean(values) * 1000, 3)}


async def _direct(engine: FixedEngine, rate: float, count: int, tokens: int) -> tuple[list[float], int]:
    from loraplex.engine.api import SamplingParams

    async def call() -> bool:
        req = GenerateRequest(request_id=secrets.token_hex(8), model=MODEL, sampling=SamplingParams(max_tokens=tokens),
                              messages=({"role": "user", "content": "Say something short about the sea."},))
        req = await engine.prepare(req)
        events = [e async for e in engine.generate(req)]
        return events[-1].finished

    return await _open_loop(call, rate, count)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(port: int, key: str, rate: float, seconds: float, concurrency: int, tokens: int,
                   pid: int, model: str = MODEL) -> dict:
    count = int(rate * seconds)
    direct, direct_failures = await _direct(FixedEngine(tokens), rate, count, tokens)
    pool = Pool(port, _request_bytes(key, port, tokens, model))  # opened after, so no connection idles out
    try:
        await _open_loop(pool.call, rate, int(rate))  # warm-up: caches, connections, code paths
        gateway, gateway_failures = await _open_loop(pool.call, rate, count)
        cpu_before = _cpu_seconds(pid)
        max_rps, max_failures, done = await _closed_loop(pool, concurrency, seconds)
        cpu_after = _cpu_seconds(pid)
    finally:
        pool.close()
    g, d = _percentiles(gateway), _percentiles(direct)
    # The gateway's own CPU per request at max_rps: steadier than latency on a shared, noisy machine.
    cpu_ms = None if cpu_before is None or cpu_after is None or not done else \
        round((cpu_after - cpu_before) * 1000 / done, 3)
    return {
        "added_latency_ms": {q: round(g[q] - d[q], 3) for q in ("p50", "p90", "p99", "mean")},
        "gateway_latency_ms": g, "direct_latency_ms": d, "rate_rps": rate, "requests": count,
        "max_rps": round(max_rps, 1), "max_rps_concurrency": concurrency, "gateway_cpu_ms_per_request": cpu_ms,
        "failures": {"gateway": gateway_failures, "direct": direct_failures, "max_rps": max_failures},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_ready(port: int, proc, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise RuntimeError("the gateway process exited during start-up")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n")
            status = int((await reader.readline()).split()[1])
            writer.close()
            if status == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("the gateway did not become ready")


def run_gateway_bench(database_url: str | None, redis_url: str | None, rate: float = 200.0, seconds: float = 10.0,
                      concurrency: int = 32, tokens: int = 16, auto: bool = False) -> dict:
    """database_url: a Postgres server to make a scratch database on (dropped after), or None (or
    "sqlite") for SQLite in a temporary directory; redis_url None (or "none"): in-process counters."""
    database_url = None if database_url == "sqlite" else database_url
    redis_url = None if redis_url == "none" else redis_url
    import tempfile

    from loraplex.platform.db.provision import create_database, drop_database
    from loraplex.platform.settings import Settings

    scratch = asyncio.run(create_database(database_url, prefix="loraplex_bench_")) if database_url else None
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=scratch, redis_url=redis_url,
                            redis_prefix=f"loraplex-bench-{secrets.token_hex(4)}:")
        try:
            models = tuple(AUTO_POOL) if auto else (MODEL,)
            key = asyncio.run(_prepare(settings, models))
            port = _free_port()
            proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(settings, port, tokens, models))
            proc.start()
            try:
                asyncio.run(_wait_ready(port, proc))
                results = asyncio.run(_measure(port, key, rate, seconds, concurrency, tokens, proc.pid))
                if auto:
                    results["auto"] = asyncio.run(_measure(port, key, rate, seconds, concurrency, tokens, proc.pid,
                                                           "auto"))
                    results["auto_vs_named"] = _auto_vs_named(results, results["auto"])
            finally:
                proc.terminate()
                proc.join(30)
        finally:
            if scratch:
                asyncio.run(drop_database(scratch))
    results.update({
        "storage": "postgres" if database_url else "sqlite", "rate_limits": "redis" if redis_url else "in-process",
        "tokens_per_response": tokens, "gateway_workers": 1,
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": pyplatform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
        "targets": {"added_latency_ms.p50": 2.0, "added_latency_ms.p99": 10.0, "max_rps": 800},
    })
    return results


def _auto_vs_named(named: dict, auto: dict) -> dict:
    """What `auto` adds: latency differences in ms, CPU per request and max_rps as ratios."""
    cpu_named, cpu_auto = named["gateway_cpu_ms_per_request"], auto["gateway_cpu_ms_per_request"]
    return {
        "added_latency_ms_diff": {q: round(auto["added_latency_ms"][q] - named["added_latency_ms"][q], 3)
                                  for q in ("p50", "p90", "p99")},
        "gateway_cpu_ratio": round(cpu_auto / cpu_named, 3) if cpu_named and cpu_auto else None,
        "max_rps_ratio": round(auto["max_rps"] / named["max_rps"], 3) if named["max_rps"] else None,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return pyplatform.processor() or "unknown"
