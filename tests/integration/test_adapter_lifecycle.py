"""Adapters through the admin API over their whole life: registered on the base model they name
(also beside other models in a pool), deleted while serving, registered again under the same name."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from litestar.testing import TestClient

from loraplex.billing.usage import MemoryUsageSink
from tests.integration.conftest import Api, Backend, RecordingEngine, tiny_engine


def _content(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _delete(api: Api, tenant: str, name: str):
    return api.client.delete(f"/admin/api/tenants/{tenant}/adapters/{name}", headers=api.admin)


def _engine_ids(api: Api, tenant: str) -> dict[str, str]:
    listed = api.client.get(f"/admin/api/tenants/{tenant}/adapters", headers=api.admin).json()
    return {a["name"]: a["engine_id"] for a in listed}


def _wait_dropped(engine: RecordingEngine, engine_id: str, base_model: str = "synthetic:tiny") -> None:
    """The engine drops a deleted adapter in the background (once its running requests end)."""
    deadline = time.monotonic() + 30
    while engine.has_adapter(engine_id, base_model):
        assert time.monotonic() < deadline, f"{engine_id} still registered in the engine"
        time.sleep(0.02)


def test_deleted_adapter_answers_404_and_leaves_the_engine(api, peft_dirs):
    tenant = api.tenant()
    key = api.key(tenant)
    assert api.adapter(tenant, "brief", peft_dirs[0]).status_code == 201
    engine_id = _engine_ids(api, tenant)["brief"]
    _content(api.chat(key, "hi", model="brief"))
    assert api.backend.engine.has_adapter(engine_id)

    r = _delete(api, tenant, "brief")
    assert r.status_code == 204, r.text
    assert _engine_ids(api, tenant) == {}
    for model in ("brief", "synthetic:tiny:brief"):
        r = api.chat(key, "hi", model=model)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    _wait_dropped(api.backend.engine, engine_id)
    assert [m["id"] for m in api.client.get("/v1/models", headers={"authorization": f"Bearer {key}"}).json()["data"]
            if m["id"] == "brief"] == []


def test_deleting_what_is_not_there_is_404(api, peft_dirs):
    tenant = api.tenant()
    r = _delete(api, tenant, "never")
    assert r.status_code == 404 and r.json()["error"]["param"] == "name"
    assert _delete(api, "no-such-tenant", "never").status_code == 404
    assert api.adapter(tenant, "once", peft_dirs[0]).status_code == 201
    assert _delete(api, tenant, "once").status_code == 204
    assert _delete(api, tenant, "once").status_code == 404
    assert api.client.delete(f"/admin/api/tenants/{tenant}/adapters/once").status_code == 401


def test_a_name_registered_again_serves_its_new_weights(api, peft_dirs):
    """SQLite hands a deleted row's id out again; the engine id must still be new, or this
    instance's engine would keep serving the deleted adapter's weights under the new row."""
    tenant = api.tenant()
    key = api.key(tenant)
    assert api.adapter(tenant, "ref", peft_dirs[1]).status_code == 201
    want_second = _content(api.chat(key, "same prompt", max_tokens=12, model="ref"))
    assert api.adapter(tenant, "v", peft_dirs[0]).status_code == 201
    first_id = _engine_ids(api, tenant)["v"]
    first = _content(api.chat(key, "same prompt", max_tokens=12, model="v"))
    assert first != want_second
    assert _delete(api, tenant, "v").status_code == 204
    assert api.adapter(tenant, "v", peft_dirs[1]).status_code == 201
    second_id = _engine_ids(api, tenant)["v"]
    assert second_id != first_id
    assert _content(api.chat(key, "same prompt", max_tokens=12, model="v")) == want_second
    _wait_dropped(api.backend.engine, first_id)
    assert api.backend.engine.has_adapter(second_id)


@pytest.fixture(scope="module")
def instance_b(postgres_backend: Backend) -> Iterator[Api]:
    """A second app instance over the same Postgres database, with an engine of its own, a short
    catalog cache and frequent adapter sweeps."""
    engine = tiny_engine()
    backend = replace(postgres_backend, name="instance-b", engine=engine)
    try:
        with TestClient(backend.app(catalog_cache_ttl_s=0.1, adapter_sweep_interval_s=0.1), timeout=60) as client:
            yield Api(client, backend, MemoryUsageSink())
    finally:
        engine.inner.shutdown()


def test_an_adapter_deleted_through_another_instance_leaves_this_ones_engine(postgres_backend, instance_b,
                                                                             peft_dirs):
    with TestClient(postgres_backend.app(), timeout=60) as client:
        a = Api(client, postgres_backend, MemoryUsageSink())
        tenant = a.tenant()
        key = a.key(tenant)
        assert a.adapter(tenant, "shared", peft_dirs[0]).status_code == 201
        engine_id = _engine_ids(a, tenant)["shared"]
        answer = _content(a.chat(key, "same prompt", max_tokens=12, model="shared"))
        assert _content(instance_b.chat(key, "same prompt", max_tokens=12, model="shared")) == answer
        assert instance_b.backend.engine.has_adapter(engine_id)  # loaded there on its first request

        assert _delete(a, tenant, "shared").status_code == 204
    _wait_dropped(instance_b.backend.engine, engine_id)  # by instance b's sweep
    r = instance_b.chat(key, "same prompt", model="shared")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_sweep_leaves_a_registration_whose_row_is_not_committed_yet(api, peft_dirs):
    """The admin API registers an adapter in the engine before its row commits; a sweep in between
    must not retire it."""
    adapters = api.client.app.state.platform.adapters
    sessions = api.client.app.state.platform.sessions
    portal = api.client.blocking_portal
    engine_id = "adapter-999999999-1"  # no such row
    portal.call(lambda: adapters.add(engine_id, str(peft_dirs[0]), "synthetic:tiny", uncommitted=True))
    assert portal.call(adapters.sweep, sessions) == []
    assert api.backend.engine.has_adapter(engine_id)
    adapters.committed(engine_id)  # as if committed, then deleted elsewhere
    assert portal.call(adapters.sweep, sessions) == [engine_id]
    _wait_dropped(api.backend.engine, engine_id)


@pytest.fixture(scope="module")
def two_models(postgres_backend: Backend) -> Iterator[Api]:
    """An app over a pool of two base models (the second a differently seeded tiny model)."""
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.pool import ModelPool

    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64, block_size=16)
    pool = ModelPool(memory_budget=1.0, device="cpu")
    for name in ("synthetic:tiny", "synthetic:tiny:2"):
        pool.register_model(name, config=config)
    engine = RecordingEngine(AsyncEngine(pool))
    backend = replace(postgres_backend, name="two-models", engine=engine)
    usage = MemoryUsageSink()
    try:
        with TestClient(backend.app(usage_sink=usage), timeout=60) as client:
            yield Api(client, backend, usage)
    finally:
        engine.inner.shutdown()


def test_an_adapter_is_registered_on_the_base_model_it_names(two_models, peft_dirs):
    api = two_models
    tenant = api.tenant()
    key = api.key(tenant)
    assert api.adapter(tenant, "second", peft_dirs[0], base_model="synthetic:tiny:2").status_code == 201
    engine_id = _engine_ids(api, tenant)["second"]
    assert api.backend.engine.has_adapter(engine_id, "synthetic:tiny:2")
    assert not api.backend.engine.has_adapter(engine_id, "synthetic:tiny")

    base = _content(api.chat(key, "same prompt", max_tokens=12, model="synthetic:tiny:2"))
    tuned = _content(api.chat(key, "same prompt", max_tokens=12, model="second"))
    assert tuned == _content(api.chat(key, "same prompt", max_tokens=12, model="synthetic:tiny:2:second"))
    assert tuned != base
    sent = api.backend.engine.requests[-1]
    assert (sent.model, sent.adapter) == ("synthetic:tiny:2", engine_id)
    r = api.chat(key, model="synthetic:tiny:second")  # the adapter is not on the other model
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    assert _delete(api, tenant, "second").status_code == 204
    _wait_dropped(api.backend.engine, engine_id, "synthetic:tiny:2")
    assert _content(api.chat(key, "same prompt", max_tokens=12, model="synthetic:tiny:2")) == base
