"""A hostile tenant (or a careless admin) against the real app over Postgres and Redis: bodies over
the limit, fields past OpenAI's bounds, values that make libraries raise, names that do not end
where they seem to, huge unknown model names, floods of bad keys. Each answers a 4xx in the OpenAI
error format, never a 500, costs no memory it keeps, and a normal request beside it is served."""

from __future__ import annotations

import gc
import hashlib
import json
import secrets
import tracemalloc
from dataclasses import replace

import pytest
from litestar.testing import TestClient

from loraplex.platform.auth import AuthCache
from loraplex.platform.db.database import make_engine, session_factory
from loraplex.platform.errors import PlatformError
from loraplex.platform.openai.schemas import MAX_JSON_DEPTH, MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_TOOLS
from loraplex.platform.tenancy.keys import create_key
from loraplex.platform.tenancy.tenants import create_tenant
from tests.integration.conftest import ADMIN_TOKEN, Api, run

MB = 1 << 20


@pytest.fixture(scope="module")
def pg(postgres_backend):
    """One app over Postgres + Redis for this module (the limits do not depend on the backend)."""
    from loraplex.billing.usage import MemoryUsageSink

    with TestClient(postgres_backend.app(), timeout=60) as client:
        yield Api(client, postgres_backend, MemoryUsageSink())


def error_of(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error body of `r`, after checking its status, param and code."""
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert len(r.content) < 2000, "an error never repeats a large input"
    return err


def served(api: Api, key: str) -> None:
    r = api.chat(key, "hello", max_tokens=2)
    assert r.status_code == 200, r.text


def nested(depth: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(depth):
        value = {"type": "array", "items": value} if isinstance(value, dict) else [value]
    return value


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_bodies_over_the_limit_answer_413_and_blobs_keep_their_own(pg):
    key = pg.key(pg.tenant())
    big = "x" * (3 * MB)
    err = error_of(pg.chat(key, big), 413, code="request_too_large")
    assert err["type"] == "invalid_request_error" and str(2 * MB) in err["message"]
    r = pg.client.post("/admin/api/tenants", json={"name": "big", "padding": big}, headers=pg.admin)
    error_of(r, 413, code="request_too_large")
    blob = secrets.token_bytes(3 * MB)  # an adapter file upload is not held to the JSON limit
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    r = pg.client.put(f"/admin/api/blobs/{digest}", content=blob, headers=pg.admin)
    assert r.status_code == 201 and r.json()["size"] == len(blob), r.text
    served(pg, key)


def test_logit_bias_is_bounded_and_keys_are_canonical(pg):
    key = pg.key(pg.tenant())
    many = {str(i): 1 for i in range(5000)}
    error_of(pg.chat(key, logit_bias=many), 400, "logit_bias")
    error_of(pg.chat(key, logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}), 400, "logit_bias")
    for spelling in ("01", "001", "+1", " 1", "1 ", "1.0", "1\n", "١", "-0", "1e2", ""):
        error_of(pg.chat(key, logit_bias={spelling: 1}), 400, "logit_bias")
    r = pg.chat(key, max_tokens=3, logit_bias={"65": 100, "1": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "AAA", r.text


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1025}]}, "messages[0].content"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": "s" * 2000}, "stop"),
    ({"stop": ["s" * 2000]}, "stop[0]"),
    ({"n": 17}, "n"),
    ({"tool_choice": "x" * 100_000}, "tool_choice"),  # the error quotes at most the start of the value
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": deep_schema(300)}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": deep_schema(MAX_JSON_DEPTH)}}]},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}", "description": "",
                                                  "parameters": {"type": "object", "description": "d" * 30_000}}}
                for i in range(10)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f\n"}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": deep_schema(300)}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": nested(200, {})}}},
     "response_format"),
])
def test_fields_past_their_bounds_answer_400_naming_the_field(pg, fields, param):
    key = pg.key(pg.tenant())
    error_of(pg.chat(key, **fields), 400, param)
    served(pg, key)


@pytest.mark.parametrize("prompt", [[2**70], [-1], [10**30, 1], [1] * 300_000, "p" * (2 * MB - 1000)])
def test_completion_prompts_out_of_range_are_a_4xx(pg, prompt):
    key = pg.key(pg.tenant())
    r = pg.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code in (400, 413), r.text[:300]
    error_of(r, r.status_code)
    served(pg, key)


def test_tool_call_arguments_nested_too_deep_are_a_400(pg):
    key = pg.key(pg.tenant())
    for arguments in ("[" * 50_000, json.dumps(nested(500)), "[" * 200 + "]" * 200):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        body = {"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
        err = error_of(pg.chat(key, **body), 400, "messages[1].tool_calls[0].function.arguments")
        assert "deep" in err["message"]
    shallow = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json [[["}}
    r = pg.chat(key, messages=[{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": None, "tool_calls": [shallow]}], max_tokens=2)
    assert r.status_code == 200, r.text


def test_a_body_nested_past_the_recursion_limit_is_a_400(pg):
    key = pg.key(pg.tenant())
    body = '{"model": "synthetic:tiny", "messages": [{"role": "user", "content": "hi"}], "extra": ' \
           + "[" * 50_000 + "]" * 50_000 + "}"
    r = pg.client.post("/v1/chat/completions", content=body,
                       headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    error_of(r, 400, code="too_deeply_nested")
    served(pg, key)


@pytest.mark.parametrize("period", ["0000-01", "9999-12-31", "9999-12", "0000-01-01", "2026-01-01..9999-12-31",
                                    "2026-13", "2026-1\uff11", "x" * 5000])
def test_usage_periods_out_of_range_are_a_400(pg, period):
    key = pg.key(pg.tenant())
    r = pg.client.get("/v1/usage", params={"period": period}, headers={"authorization": f"Bearer {key}"})
    error_of(r, 400, "period")
    r = pg.client.get("/v1/usage", params={"period": "9999-11"}, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/keys", {"expires_in_s": 10**10}, "expires_in_s"),
    ("/keys", {"expires_in_s": 10**30}, "expires_in_s"),
    ("/keys", {"expires_at": "9999-12-31T23:59:59-14:00"}, "expires_at"),
    ("/keys", {"rpm_limit": 2**40}, "rpm_limit"),
    ("/keys", {"tpm_limit": 2**31}, "tpm_limit"),
    ("/keys", {"allowed_models": ["m" * 1000]}, "allowed_models"),
    ("", {"default_max_tokens": 2**40}, "default_max_tokens"),
])
def test_admin_values_out_of_range_are_a_400(pg, path, body, param):
    tenant = pg.tenant()
    if path == "":
        r = pg.client.patch(f"/admin/api/tenants/{tenant}", json=body, headers=pg.admin)
    else:
        r = pg.client.post(f"/admin/api/tenants/{tenant}{path}", json=body, headers=pg.admin)
    error_of(r, 400, param)
    assert pg.client.post(f"/admin/api/tenants/{tenant}/keys", json={"expires_in_s": 3600},
                          headers=pg.admin).status_code == 201


def test_budgets_past_what_the_counters_hold_are_a_400(pg):
    tenant = pg.tenant()
    for limit in (2**53, 2**70, 10**100):
        r = pg.client.post("/admin/api/budgets", json={"tenant": tenant, "period": "day", "limit_tokens": limit},
                           headers=pg.admin)
        error_of(r, 400, "limit_tokens")
    r = pg.client.post("/admin/api/budgets", json={"tenant": tenant, "period": "day", "limit_tokens": 2**53 - 1},
                       headers=pg.admin)
    assert r.status_code == 200, r.text


def test_admin_strings_longer_than_their_columns_are_a_400(pg):
    r = pg.client.post("/admin/api/tenants", json={"name": pg.tenant().replace("t-", "u-"), "tier": "t" * 40},
                       headers=pg.admin)
    error_of(r, 400, "tier")
    r = pg.client.post("/admin/api/models", json={"name": f"m-{secrets.token_hex(4)}", "source": "s" * 2000},
                       headers=pg.admin)
    error_of(r, 400, "source")
    tenant = pg.tenant()
    r = pg.client.post(f"/admin/api/tenants/{tenant}/adapters", headers=pg.admin,
                       json={"name": "a", "base_model": "synthetic:tiny", "path": "/" + "p" * 5000})
    error_of(r, 400, "path")


@pytest.mark.parametrize("name", ["acme\n", "acme\r\n", "acme ", "\nacme", "ac\nme"])
def test_names_match_whole(pg, name):
    error_of(pg.client.post("/admin/api/tenants", json={"name": name}, headers=pg.admin), 400, "name")
    tenant = pg.tenant()
    error_of(pg.client.post(f"/admin/api/tenants/{tenant}/keys", json={"name": name}, headers=pg.admin), 400, "name")
    error_of(pg.adapter(tenant, name, "/nowhere"), 400, "name")
    error_of(pg.client.post("/admin/api/models", json={"name": name}, headers=pg.admin), 400, "name")
    error_of(pg.client.post("/admin/api/budgets", json={"tenant": tenant, "period": "day\n", "limit_tokens": 10},
                            headers=pg.admin), 400, "period")
    r = pg.client.post("/admin/api/prices", headers=pg.admin,
                       json={"model": "synthetic:tiny", "input_per_1m": "1", "cached_input_per_1m": "1",
                             "output_per_1m": "1", "currency": "USD\n"})
    error_of(r, 400, "currency")
    key = pg.key(tenant)
    error_of(pg.chat(key, model=f"synthetic:tiny{name}"), 404, "model", "model_not_found")
    served(pg, key)


def test_a_nul_in_a_name_is_a_4xx_not_a_database_outage(pg):
    """Postgres refuses NUL in text (SQLSTATE 22021): found by the fuzzer as 503s on every lookup."""
    tenant = pg.tenant()
    key = pg.key(tenant)
    error_of(pg.chat(key, model="synthetic:tiny\u0000"), 404, "model", "model_not_found")
    error_of(pg.client.get("/v1/models/a%00b", headers={"authorization": f"Bearer {key}"}), 404)
    for path in ("/admin/api/tenants/a%00b", "/admin/api/tenants/a%00b/keys", "/admin/api/budgets?tenant=a%00b",
                 "/admin/api/prices?model=a%00b"):
        r = pg.client.get(path, headers=pg.admin)
        assert r.status_code in (400, 404), (path, r.text)
        error_of(r, r.status_code)
    r = pg.client.post("/admin/api/models", json={"name": "x\u0000"}, headers=pg.admin)
    error_of(r, 400)
    served(pg, key)


def test_huge_unknown_model_names_answer_404_and_keep_no_memory(pg):
    key = pg.key(pg.tenant())
    router = pg.client.app.state.platform.router
    name = "m" * MB

    def ask(i: int) -> None:
        err = error_of(pg.chat(key, model=f"{i}{name}"), 404, "model", "model_not_found")
        assert len(err["message"]) < 300

    for i in range(5):  # warm-up: whatever is allocated once
        ask(i)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            ask(i)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20 * MB, f"{grown / MB:.1f} MB kept after 200 lookups of 1 MB names"
    for i in range(300):  # unknown short names: not remembered per string either
        error_of(pg.chat(key, model=f"no-such-adapter-{i}"), 404, "model", "model_not_found")
    assert router.cached_adapters == 0
    served(pg, key)


def test_bad_keys_never_evict_a_good_key(postgres_backend):
    """2,000 distinct bad keys (20 times the cache's size here) through the real database; the good
    key is then still answered from the cache: no database session opened for it."""
    opened = [0]

    async def flood():
        engine = make_engine(postgres_backend.settings.database_url)
        sessions = session_factory(engine)

        def counting():
            opened[0] += 1
            return sessions()

        try:
            async with sessions() as session:
                tenant = f"flood-{secrets.token_hex(4)}"
                await create_tenant(session, tenant)
                _, good = await create_key(session, tenant)
            auth = AuthCache(counting, ttl_s=3600, max_entries=100)
            assert (await auth.authenticate(f"Bearer {good}")).tenant == tenant
            for i in range(2000):
                with pytest.raises(PlatformError) as refused:
                    await auth.authenticate(f"Bearer lpx-{i:08d}{secrets.token_hex(16)}")
                assert refused.value.status == 401
            assert auth.cached_keys == 1
            before = opened[0]
            assert (await auth.authenticate(f"Bearer {good}")).tenant == tenant
            assert opened[0] == before, "the good key was evicted and read again"
        finally:
            await engine.dispose()

    run(flood())


class FromAddress:
    """The app as reached from the address in an `x-test-address` header (TestClient's is fixed)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            address = dict(scope["headers"]).get(b"x-test-address")
            if address:
                scope = {**scope, "client": (address.decode(), 4000)}
        await self.app(scope, receive, send)


def test_failed_authentication_is_throttled_per_address(postgres_backend):
    settings = replace(postgres_backend.settings, auth_max_failures=5, auth_failure_window_s=300)
    from loraplex.platform.app import create_app

    app = create_app(settings, postgres_backend.engine)
    with TestClient(FromAddress(app), timeout=60) as client:
        api = Api(client, postgres_backend, None)
        good = api.key(api.tenant())

        def chat(key: str, address: str):
            return api.post("/v1/chat/completions", key, {"model": "synthetic:tiny", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]},
                            **{"x-test-address": address})

        for i in range(5):
            error_of(chat(f"lpx-bad{i:04d}{secrets.token_hex(16)}", "10.0.0.66"), 401, code="invalid_api_key")
        r = chat(f"lpx-bad{secrets.token_hex(16)}", "10.0.0.66")
        error_of(r, 429, code="too_many_auth_failures")
        assert 0 < int(r.headers["retry-after"]) <= 300
        error_of(chat(good, "10.0.0.66"), 429, code="too_many_auth_failures")  # locked, whatever it sends
        assert chat(good, "10.0.0.7").status_code == 200  # another address is served
        r = client.get("/admin/api/tenants", headers={"authorization": f"Bearer {ADMIN_TOKEN}",
                                                      "x-test-address": "10.0.0.66"})
        assert r.status_code == 200  # the tenant API's limit is its own
