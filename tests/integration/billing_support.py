"""Helpers for the billing tests: apps with their own engines, reading the ledger and the live
counters, and an engine whose generations end however a test wants."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from litestar.testing import TestClient
from sqlalchemy import func, select

from loraplex.billing.tables import usage_daily, usage_ledger
from loraplex.cli.bench.gateway import FixedEngine
from loraplex.engine.api import EngineError, GenerateEvent, GenerateRequest, ModelInfo, Usage
from loraplex.platform.app import create_app
from tests.integration.conftest import ADMIN_TOKEN, run

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
FAKE_MODEL = "scripted"
FAKE_PROMPT_TOKENS = 10


class ScriptedEngine(FixedEngine):
    """An EngineClient whose every generation yields `tokens` tokens, then ends as `ending` says:
    stop (normally), error (a last event with finish_reason error), raise (the stream raises),
    abort (the engine aborts it), hang (waits until cancelled), refuse (generate raises).
    While `gate` is clear, generations wait before their first token (any app's loop)."""

    def __init__(self, ending: str = "stop", tokens: int = 3):
        super().__init__(tokens)
        self.ending = ending
        self.aborted: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = 0  # generations held at the gate
        self._lock = threading.Lock()

    def _hold(self, delta: int) -> None:
        with self._lock:
            self.waiting += delta

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(FAKE_MODEL, 4096, 256)]

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        return replace(request, prompt=None, messages=None, prompt_token_ids=(1,) * FAKE_PROMPT_TOKENS)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        if self.ending == "refuse":
            raise EngineError("the engine is full")
        return self._events(request)

    async def _events(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        rid = request.request_id
        self._hold(1)
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        self._hold(-1)
        for _ in range(self.tokens):
            await asyncio.sleep(0)
            yield GenerateEvent(rid, "x", (120,))
        usage = Usage(FAKE_PROMPT_TOKENS, self.tokens)
        if self.ending == "raise":
            raise RuntimeError("the engine crashed")
        if self.ending == "hang":
            await asyncio.Event().wait()
        reason = {"stop": "stop", "error": "error", "abort": "abort"}[self.ending]
        yield GenerateEvent(rid, finish_reason=reason, usage=usage, error="boom" if reason == "error" else None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def app_client(backend, engine=None, **overrides) -> TestClient:
    """A TestClient (use it as a context manager) over an app of `backend`, with its own engine."""
    app = create_app(replace(backend.settings, **overrides), engine or backend.engine)
    return TestClient(app, timeout=60)


def platform_of(client: TestClient):
    return client.app.state.platform


def in_app(client: TestClient, fn, *args):
    """Runs an async function on the app's own event loop."""
    return client.blocking_portal.call(fn, *args)


def flush(*clients: TestClient) -> None:
    """Every request that ended is settled and its usage written (settlement runs after the response)."""
    for client in clients:
        in_app(client, platform_of(client).flush_usage)


def new_tenant(client: TestClient, prefix: str = "bill", **fields) -> tuple[str, int, str]:
    """(name, id, a key) of a new tenant."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    made = client.post("/admin/api/tenants", json={"name": name, **fields}, headers=ADMIN)
    assert made.status_code == 201, made.text
    key = client.post(f"/admin/api/tenants/{name}/keys", json={}, headers=ADMIN).json()["key"]
    return name, made.json()["id"], key


def set_budget(client: TestClient, tenant: str, limit: int, period: str = "month", **fields) -> dict:
    r = client.post("/admin/api/budgets", json={"tenant": tenant, "period": period, "limit_tokens": limit, **fields},
                    headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def budgets(client: TestClient, tenant: str) -> list[dict]:
    r = client.get(f"/admin/api/budgets?tenant={tenant}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def complete(client: TestClient, key: str, model: str = "synthetic:tiny", **fields):
    body = {"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0, **fields}
    return client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})


def ledger_rows(settings, tenant_id: int) -> list:
    async def query(engine):
        async with engine.connect() as conn:
            stmt = select(usage_ledger).where(usage_ledger.c.tenant_id == tenant_id).order_by(usage_ledger.c.id)
            return (await conn.execute(stmt)).all()

    return with_db(settings, query)


def rollup_tokens(settings, tenant_id: int) -> int:
    async def query(engine):
        async with engine.connect() as conn:
            stmt = (select(func.coalesce(func.sum(usage_daily.c.prompt_tokens + usage_daily.c.completion_tokens), 0))
                    .where(usage_daily.c.tenant_id == tenant_id))
            return (await conn.execute(stmt)).scalar_one()

    return int(with_db(settings, query))


def with_db(settings, work):
    from loraplex.platform.db.database import make_engine

    async def main():
        engine = make_engine(settings.effective_database_url)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    return run(main())


def tokens(rows) -> int:
    return sum(r.prompt_tokens + r.completion_tokens for r in rows)


def assert_counters_match_ledger(client: TestClient, tenant: str, tenant_id: int) -> list:
    """After every request ended and the ledger is flushed: nothing reserved, and each budget's
    live counter equals what the ledger holds; returns the tenant's ledger rows."""
    flush(client)
    rows = ledger_rows(platform_of(client).settings, tenant_id)
    listed = budgets(client, tenant)
    assert listed, "the test must give the tenant a budget to see its counters"
    for b in listed:
        assert b["counter_reserved_tokens"] == 0, b
        assert b["counter_used_tokens"] == b["used_tokens"], b
    assert rollup_tokens(platform_of(client).settings, tenant_id) == tokens(rows)
    return rows


PROMPT = 11  # "hello world" with the byte-level tokenizer
# 32 client threads and two apps on a small machine: a Redis round trip can wait on a busy event
# loop longer than the default 0.5 s, which would turn budgeted requests into 503s.
SLOW_OK = {"redis_timeout_s": 5.0}


def flood_two_instances(a: TestClient, b: TestClient, requests: int = 200, fit: int = 50) -> None:
    """`requests` concurrent 8-token completions, alternating between two serving instances, against a
    budget that `fit` of them fill: the rest are 429 insufficient_quota, the ledger holds exactly the
    answered ones, never over the budget, and both instances' counters agree with it."""
    limit = fit * (PROMPT + 8)
    tenant, tenant_id, key = new_tenant(a, "burst")
    set_budget(a, tenant, limit)
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda i: complete((a, b)[i % 2], key, max_tokens=8), range(requests)))
    statuses = [r.status_code for r in answers]
    assert set(statuses) == {200, 429}, statuses
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in answers if r.status_code == 429)
    ok = [r.headers["x-request-id"] for r in answers if r.status_code == 200]
    assert len(ok) >= fit  # the first reservations fit whatever their order
    flush(a, b)
    rows = ledger_rows(platform_of(a).settings, tenant_id)
    assert tokens(rows) <= limit
    assert sorted(r.request_id for r in rows) == sorted(ok) and len(set(ok)) == len(ok)
    for client in (a, b):
        assert_counters_match_ledger(client, tenant, tenant_id)
