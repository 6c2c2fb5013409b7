"""The real `loraplex serve` process against schemas built to stall a grammar engine: two identical
recursive alternatives (a naive matcher doubles its state on every `[`) and enums of 150k and 300k
values. Each fails or finishes alone: normal requests sent while it runs are answered, and the
engine ends with no request running and no KV block held."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.e2e.server import admin_request, serving, tenant_key

ADMIN = "e2e-admin-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("data"), ADMIN) as srv:
        yield srv


@pytest.fixture(scope="module")
def key(server) -> str:
    return tenant_key(server, ADMIN, "schemas")


def recursive_alternatives() -> dict:
    alt = {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/x"}}
    return {"$defs": {"x": {"anyOf": [alt, dict(alt)]}}, "$ref": "#/$defs/x"}


def post(server, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}"})


def guided(schema: dict, max_tokens: int = 64) -> dict:
    return {"model": "synthetic:tiny", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "nested arrays please"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


NORMAL = {"model": "synthetic:tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}


def engine_idle(server) -> dict:
    """Engine stats once nothing runs (polled: a finished request's blocks return within a step)."""
    for _ in range(100):
        stats = admin_request(server, ADMIN, "GET", "/engine/stats").json()
        if stats["requests"]["running"] == 0 and stats["requests"]["waiting"] == 0 and stats["kv"]["blocks_used"] == 0:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"the engine did not come back to idle: {stats}")


def ends_alone(server, key: str, hostile: dict) -> httpx.Response:
    """Sends `hostile`, and while it is in flight, normal requests one after another: each of them
    is answered, and the hostile one ends (any status) without a 5xx."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, server, key, hostile)
        normal = []
        while not pending.done() and len(normal) < 20:
            normal.append(post(server, key, NORMAL))
        hostile_reply = pending.result(timeout=120)
    assert all(r.status_code == 200 for r in normal), [r.text[:200] for r in normal]
    assert hostile_reply.status_code < 500, hostile_reply.text[:300]
    engine_idle(server)
    return hostile_reply


def test_recursive_alternatives_finish_alone(server, key):
    r = ends_alone(server, key, guided(recursive_alternatives()))
    if r.status_code == 200:  # held to the schema: nested non-empty arrays, cut by max_tokens at worst
        text = r.json()["choices"][0]["message"]["content"]
        assert text.startswith("[") and set(text) <= set("[], \n\t"), text[:200]


def test_huge_enums_fail_alone(server, key):
    too_big = guided({"type": "string", "enum": [f"v{i}" for i in range(300_000)]}, max_tokens=16)
    r = ends_alone(server, key, too_big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
    under_body_limit = guided({"type": "string", "enum": [f"{i:x}" for i in range(150_000)]}, max_tokens=16)
    r = ends_alone(server, key, under_body_limit)
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "response_format", r.text[:300]
