"""`model: "auto"` through the real app, on Postgres + Redis and on SQLite: an engine serving a
small model (short context) and a large one, put in auto's pool through the admin API, with
prices; every request's model is checked where the engine got it, in the response and its
headers, and in the ledger row (routed_from, the chosen model's price). These apps score with the
heuristic (LORAPLEX_ROUTER=heuristic), whose scores the tests can name; test_auto_calibration.py
serves the learned scorer."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

import pytest

from loraplex.engine.config import EngineConfig
from tests.integration.billing_support import ADMIN, app_client, flush, ledger_rows, new_tenant
from tests.integration.conftest import RecordingEngine

SIMPLE = "Hello there"
# 0.5667: a fenced block (code 1 x 0.25), prove, compare, justify (reasoning 1 x 0.25), prove (math 1/3 x 0.2)
COMPLEX = "```\nf(x)\n```\nProve it halts, compare and justify"
SMALL_CONTEXT = 160


@dataclass
class Setup:
    client: object
    engine: RecordingEngine
    small: str
    large: str

    def chat(self, key: str, content: str, **fields):
        body = {"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0, **fields}
        return self.client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})

    def route(self, model: str, value):
        return self.client.patch(f"/admin/api/models/{model}", json={"auto_max_complexity": value}, headers=ADMIN)

    def price(self, model: str, input_per_1m: str, output_per_1m: str):
        r = self.client.post("/admin/api/prices", headers=ADMIN, json={
            "model": model, "input_per_1m": input_per_1m, "cached_input_per_1m": "0", "output_per_1m": output_per_1m})
        assert r.status_code == 201, r.text


def two_model_engine(small: str, large: str) -> RecordingEngine:
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.pool import ModelPool

    engine = AsyncEngine(ModelPool(memory_budget=1.0, device="cpu"))
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64, block_size=16)
    engine.register_model(small, "synthetic:tiny:2", config=replace(config, max_model_len=SMALL_CONTEXT))
    engine.register_model(large, "synthetic:tiny", config=config)
    return RecordingEngine(engine)


@pytest.fixture(scope="module")
def setup(backend):
    tag = secrets.token_hex(3)
    small, large = f"auto-small-{tag}", f"auto-large-{tag}"
    engine = two_model_engine(small, large)
    try:
        with app_client(backend, engine, router="heuristic") as client:
            yield Setup(client, engine, small, large)
    finally:
        engine.inner.shutdown()


def listed(setup: Setup, key: str) -> set[str]:
    r = setup.client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


def test_auto_is_offered_only_once_a_model_is_in_its_pool(setup):
    _, _, key = new_tenant(setup.client, "auto")
    assert "auto" not in listed(setup, key)
    r = setup.chat(key, SIMPLE)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert setup.client.get("/v1/models/auto", headers={"authorization": f"Bearer {key}"}).status_code == 404
    r = setup.route(setup.small, 0.3)
    assert r.status_code == 200 and r.json()["auto_max_complexity"] == 0.3, r.text
    assert setup.route(setup.large, 1).json()["auto_max_complexity"] == 1.0
    assert {"auto", setup.small, setup.large} <= listed(setup, key)
    card = setup.client.get("/v1/models/auto", headers={"authorization": f"Bearer {key}"})
    assert card.status_code == 200 and card.json()["id"] == "auto"
    models = {m["name"]: m["auto_max_complexity"] for m in setup.client.get("/admin/api/models", headers=ADMIN).json()}
    assert models[setup.small] == 0.3 and models[setup.large] == 1.0


def test_simple_requests_go_to_the_small_model_and_complex_ones_to_the_large(setup, backend):
    setup.route(setup.small, 0.3)
    setup.route(setup.large, 1.0)
    name, tenant_id, key = new_tenant(setup.client, "auto")
    simple, hard = setup.chat(key, SIMPLE), setup.chat(key, COMPLEX)
    assert simple.status_code == hard.status_code == 200, (simple.text, hard.text)
    assert simple.json()["model"] == simple.headers["x-loraplex-model"] == setup.small
    assert simple.headers["x-loraplex-complexity"] == "0.0000"
    assert hard.json()["model"] == hard.headers["x-loraplex-model"] == setup.large
    assert hard.headers["x-loraplex-complexity"] == "0.5667"
    assert [r.model for r in setup.engine.requests[-2:]] == [setup.small, setup.large]
    flush(setup.client)
    rows = {r.model: r for r in ledger_rows(backend.settings, tenant_id)}  # (written in either order)
    assert set(rows) == {setup.small, setup.large} and {r.routed_from for r in rows.values()} == {"auto"}
    assert rows[setup.small].route_score == 0.0 and rows[setup.large].route_score == pytest.approx(0.5667)
    assert rows[setup.small].prompt_tokens == simple.json()["usage"]["prompt_tokens"]
    assert rows[setup.large].prompt_tokens == hard.json()["usage"]["prompt_tokens"]
    named = setup.client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
        "model": setup.large, "messages": [{"role": "user", "content": SIMPLE}], "max_tokens": 2})
    assert named.status_code == 200 and "x-loraplex-model" not in named.headers
    flush(setup.client)
    assert ledger_rows(backend.settings, tenant_id)[-1].routed_from is None
    assert ledger_rows(backend.settings, tenant_id)[-1].route_score is None
    metrics = setup.client.get("/metrics", headers=ADMIN).text
    assert f'loraplex_auto_routed_requests_total{{model="{setup.small}"}}' in metrics
    assert "loraplex_auto_request_complexity_count" in metrics


def test_streams_name_the_model_chosen(setup):
    setup.route(setup.small, 0.3)
    _, _, key = new_tenant(setup.client, "auto")
    with setup.client.stream("POST", "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
            "model": "auto", "messages": [{"role": "user", "content": SIMPLE}], "max_tokens": 3,
            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["x-loraplex-model"] == setup.small
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(f'"model":"{setup.small}"' in c for c in chunks)


def test_a_prompt_the_small_context_cannot_hold_goes_to_the_large_model(setup):
    setup.route(setup.small, 0.3)
    setup.route(setup.large, 1.0)
    _, _, key = new_tenant(setup.client, "auto")
    r = setup.chat(key, "a" * (SMALL_CONTEXT + 10))  # one byte-level token a character
    assert r.status_code == 200 and r.json()["model"] == setup.large
    assert float(r.headers["x-loraplex-complexity"]) < 0.3  # simple, but too long for the small one
    fits = setup.chat(key, "a" * 40, max_tokens=4)
    assert fits.json()["model"] == setup.small
    room = setup.chat(key, "a" * 40, max_tokens=SMALL_CONTEXT)  # the answer would not fit
    assert room.json()["model"] == setup.large


def test_keys_limited_to_some_models_route_among_those_only(setup):
    setup.route(setup.small, 0.3)
    setup.route(setup.large, 1.0)
    name, _, _ = new_tenant(setup.client, "auto")
    key = setup.client.post(f"/admin/api/tenants/{name}/keys", headers=ADMIN,
                            json={"allowed_models": [setup.small]}).json()["key"]
    r = setup.chat(key, COMPLEX)
    assert r.status_code == 200 and r.json()["model"] == setup.small  # the most capable it may use
    assert setup.large not in listed(setup, key) and "auto" in listed(setup, key)
    other = setup.client.post(f"/admin/api/tenants/{name}/keys", headers=ADMIN,
                              json={"allowed_models": ["not-in-the-pool"]}).json()["key"]
    assert setup.chat(other, SIMPLE).status_code == 404 and "auto" not in listed(setup, other)
    only_auto = setup.client.post(f"/admin/api/tenants/{name}/keys", headers=ADMIN,
                                  json={"allowed_models": ["auto"]}).json()["key"]
    assert setup.chat(only_auto, COMPLEX).json()["model"] == setup.large  # the whole pool, through auto
    assert setup.chat(only_auto, SIMPLE).json()["model"] == setup.small
    named = setup.client.post("/v1/chat/completions", headers={"authorization": f"Bearer {only_auto}"}, json={
        "model": setup.large, "messages": [{"role": "user", "content": SIMPLE}], "max_tokens": 2})
    assert named.status_code == 404 and listed(setup, only_auto) == {"auto"}


def test_a_model_taken_out_of_the_pool_is_no_longer_chosen(setup):
    setup.route(setup.small, 0.3)
    setup.route(setup.large, 1.0)
    _, _, key = new_tenant(setup.client, "auto")
    r = setup.route(setup.small, None)
    assert r.status_code == 200 and r.json()["auto_max_complexity"] is None
    assert setup.chat(key, SIMPLE).json()["model"] == setup.large
    setup.route(setup.small, 0.3)
    assert setup.chat(key, SIMPLE).json()["model"] == setup.small


def test_prices_decide_among_the_models_that_can_take_a_request(setup, backend):
    """Last in this module: prices cannot be taken back. The large model priced below the small one
    takes the simple requests too, and its ledger row carries its own price."""
    setup.route(setup.small, 0.3)
    setup.route(setup.large, 1.0)
    _, tenant_id, key = new_tenant(setup.client, "auto")
    setup.price(setup.large, "10", "20")
    assert setup.chat(key, SIMPLE).json()["model"] == setup.small  # unpriced: free
    setup.price(setup.small, "2", "4")
    assert setup.chat(key, SIMPLE).json()["model"] == setup.small
    setup.price(setup.large, "1", "2")  # from now on
    r = setup.chat(key, SIMPLE)
    assert r.status_code == 200 and r.json()["model"] == setup.large, r.text
    flush(setup.client)
    rows = ledger_rows(backend.settings, tenant_id)
    assert sorted(row.model for row in rows) == [setup.large] + [setup.small] * 2
    (last,) = [row for row in rows if row.model == setup.large]
    usage = r.json()["usage"]
    assert last.routed_from == "auto" and last.currency == "USD"
    assert last.cost_picos == usage["prompt_tokens"] * 1_000_000 + usage["completion_tokens"] * 2_000_000


def test_bad_routes_and_the_reserved_name_are_refused(setup):
    for value in (1.5, -0.1, "high", True):
        r = setup.route(setup.small, value)
        assert r.status_code == 400, (value, r.text)
    assert setup.route("no-such-model", 0.5).status_code == 404
    r = setup.client.post("/admin/api/models", json={"name": "auto"}, headers=ADMIN)
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"]
    name, _, _ = new_tenant(setup.client, "auto")
    r = setup.client.post(f"/admin/api/tenants/{name}/adapters", headers=ADMIN,
                          json={"name": "auto", "base_model": setup.small, "path": "/nowhere"})
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"]
    made = setup.client.post("/admin/api/models", headers=ADMIN, json={
        "name": f"routed-{secrets.token_hex(3)}", "auto_max_complexity": 0.7})
    assert made.status_code == 201 and made.json()["auto_max_complexity"] == 0.7
