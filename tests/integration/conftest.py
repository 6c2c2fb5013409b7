"""Integration fixtures: a fresh Postgres database and a Redis key prefix for this run, a migrated
SQLite file, a tiny in-process engine per backend, and apps over them driven with TestClient.

LORAPLEX_TEST_DATABASE_URL (any database on the server; we connect as its user to create ours)
and LORAPLEX_TEST_REDIS_URL default to the local services.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
from litestar.testing import TestClient

from loraplex.billing.usage import MemoryUsageSink
from loraplex.cli.bench.live_server import delete_redis_prefix
from loraplex.platform.app import create_app
from loraplex.platform.db.database import make_engine
from loraplex.platform.db.migrate import upgrade
from loraplex.platform.db.provision import create_database, drop_database
from loraplex.platform.settings import Settings

PG_SERVER = os.environ.get("LORAPLEX_TEST_DATABASE_URL", "postgresql://postgres@localhost:5432/postgres")
REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://localhost:6379/0")
ADMIN_TOKEN = "test-admin-token"


def run(coro):
    return asyncio.run(coro)


async def _migrate(url: str) -> None:
    engine = make_engine(url)
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A database made for this run (loraplex_test_<random>) and dropped after it, migrated to head."""
    url = run(create_database(PG_SERVER))
    try:
        run(_migrate(url))
        yield url
    finally:
        run(drop_database(url))


@pytest.fixture
def proxy(pg_url):
    """A TCP proxy in front of the test Postgres (tcp_proxy.py): a test cuts it or drops its packets."""
    from sqlalchemy.engine import make_url

    from tests.integration.tcp_proxy import TcpProxy

    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "localhost", url.port or 5432).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="session")
def redis_prefix() -> Iterator[str]:
    """Keys of this run live under their own prefix, deleted at the end, so parallel runs never meet."""
    prefix = f"loraplex-test-{secrets.token_hex(4)}:"
    yield prefix
    run(delete_redis_prefix(REDIS_URL, prefix))




@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sqlite') / 'loraplex.db'}"
    run(_migrate(url))
    return url


class RecordingEngine:
    """An EngineClient that passes everything to an AsyncEngine and remembers each request generated,
    with the prompt (text or messages) it was prepared from."""

    def __init__(self, inner):
        self.inner = inner
        self.requests = []
        self._asked = {}  # (model, prompt token ids) -> the request as prepare() got it

    def models(self):
        return self.inner.models()

    async def prepare(self, request):
        prepared = await self.inner.prepare(request)
        self._asked[(prepared.model, prepared.prompt_token_ids)] = request
        return prepared

    def generate(self, request):
        asked = self._asked.get((request.model, request.prompt_token_ids))
        self.requests.append(request if asked is None else replace(
            request, prompt=asked.prompt, messages=asked.messages, prompt_token_ids=asked.prompt_token_ids))
        return self.inner.generate(request)

    async def abort(self, request_id):
        await self.inner.abort(request_id)

    def add_adapter(self, adapter_id, path, base_model=None):
        self.inner.add_adapter(adapter_id, path, base_model)

    def has_adapter(self, adapter_id, base_model=None):
        return self.inner.has_adapter(adapter_id, base_model)

    async def remove_adapter(self, adapter_id, base_model=None):
        await self.inner.remove_adapter(adapter_id, base_model)

    def stats(self):
        return self.inner.stats()

    def replicas(self):
        return self.inner.replicas()

    def compute_path(self):
        return self.inner.compute_path()


def tiny_engine() -> RecordingEngine:
    from loraplex.engine.async_engine import AsyncEngine
    from tests.conftest import make_core

    return RecordingEngine(AsyncEngine(make_core()))


@dataclass
class Backend:
    """One storage set-up: the settings an app gets and the engine behind it."""

    name: str
    settings: Settings
    engine: RecordingEngine

    def app(self, usage_sink=None, plugins=(), **overrides):
        return create_app(replace(self.settings, **overrides), self.engine, usage_sink=usage_sink, plugins=plugins)


@pytest.fixture(scope="session")
def postgres_backend(pg_url, redis_prefix, tmp_path_factory) -> Iterator[Backend]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("pgdata"), database_url=pg_url, redis_url=REDIS_URL,
                        redis_prefix=redis_prefix, admin_token=ADMIN_TOKEN)
    backend = Backend("postgres", settings, tiny_engine())
    yield backend
    backend.engine.inner.shutdown()


@pytest.fixture(scope="session")
def sqlite_backend(sqlite_url, tmp_path_factory) -> Iterator[Backend]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("sqlitedata"), database_url=sqlite_url,
                        admin_token=ADMIN_TOKEN)
    backend = Backend("sqlite", settings, tiny_engine())
    yield backend
    backend.engine.inner.shutdown()


@pytest.fixture(scope="session", params=["postgres", "sqlite"])
def backend(request) -> Backend:
    """The same API tests on Postgres + Redis and on embedded SQLite + in-process counters."""
    return request.getfixturevalue(f"{request.param}_backend")


@dataclass
class Api:
    """A running app and helpers to make tenants and keys through its admin API."""

    client: TestClient
    backend: Backend
    usage: MemoryUsageSink

    @property
    def admin(self) -> dict:
        return {"authorization": f"Bearer {ADMIN_TOKEN}"}

    def tenant(self, prefix: str = "t") -> str:
        name = f"{prefix}-{secrets.token_hex(4)}"
        r = self.client.post("/admin/api/tenants", json={"name": name}, headers=self.admin)
        assert r.status_code == 201, r.text
        return name

    def key(self, tenant: str, **spec) -> str:
        r = self.client.post(f"/admin/api/tenants/{tenant}/keys", json=spec, headers=self.admin)
        assert r.status_code == 201, r.text
        return r.json()["key"]

    def adapter(self, tenant: str, name: str, path, base_model: str = "synthetic:tiny"):
        return self.client.post(f"/admin/api/tenants/{tenant}/adapters", headers=self.admin,
                                json={"name": name, "base_model": base_model, "path": str(path)})

    def post(self, path: str, key: str, body: dict, **headers):
        return self.client.post(path, json=body, headers={"authorization": f"Bearer {key}", **headers})

    def chat(self, key: str, content: str = "hello", **fields):
        body = {"model": "synthetic:tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                "temperature": 0, **fields}
        return self.post("/v1/chat/completions", key, body)


@pytest.fixture(scope="session")
def api(backend) -> Iterator[Api]:
    usage = MemoryUsageSink()
    with TestClient(backend.app(usage_sink=usage), timeout=60) as client:
        yield Api(client, backend, usage)


@pytest.fixture(scope="session")
def peft_dirs(tmp_path_factory):
    """Two different PEFT adapters for synthetic:tiny."""
    from loraplex.engine.models.loader import load_model, resolve_model
    from tests.lora_factory import make_peft_dir

    config = load_model(resolve_model("synthetic:tiny")).config
    root = tmp_path_factory.mktemp("peft")
    return [make_peft_dir(root / f"a{i}", config, rank=8, alpha=16, targets="all", seed=i + 1) for i in range(2)]
