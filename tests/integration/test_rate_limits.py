"""RPM/TPM limits: 429 with OpenAI's headers, shared across instances through Redis, the Lua
scripts against the in-process store, and Redis down (fail-closed by default, or fail-open)."""

from __future__ import annotations

import asyncio
import math
import secrets
import time

import pytest
from litestar.testing import TestClient

from loraplex.billing.ratelimit import Limits, MemoryRateLimiter
from loraplex.billing.redis_ratelimit import RedisRateLimiter
from tests.integration.conftest import REDIS_URL, run


def test_rpm_limit_answers_429_with_headers(api):
    key = api.key(api.tenant(), rpm_limit=2)
    first = api.chat(key, max_tokens=1)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"].endswith(("ms", "s"))
    assert api.chat(key, max_tokens=1).status_code == 200
    refused = api.chat(key, max_tokens=1)
    assert refused.status_code == 429
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    metrics = api.client.get("/metrics", headers=api.admin).text
    assert 'loraplex_rate_limit_rejections_total{limit="requests"}' in metrics


def test_tpm_limit_reserves_prompt_plus_max_tokens_and_refunds_the_unused(api):
    def complete(key):
        return api.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": "abcdefghij", "max_tokens": 20})

    key = api.key(api.tenant(), tpm_limit=100)
    t0 = time.monotonic()
    first = complete(key)  # 10 prompt tokens (byte-level tokenizer) + 20 reserved
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-remaining-tokens"] == "70"
    unused = 20 - first.json()["usage"]["completion_tokens"]
    second = complete(key)
    # The bucket refills 100 tokens a minute meanwhile: one token per 0.6 s between the two admissions.
    refilled = math.ceil((time.monotonic() - t0) * 100 / 60)
    assert 70 + unused - 30 <= int(second.headers["x-ratelimit-remaining-tokens"]) <= 70 + unused - 30 + refilled
    small = api.key(api.tenant(), tpm_limit=30)
    assert complete(small).status_code == 200
    over = complete(small)  # at most 20 unused tokens came back: less than the 30 it needs
    assert over.status_code == 429 and over.json()["error"]["type"] == "tokens"
    assert over.headers["x-ratelimit-limit-tokens"] == "30" and int(over.headers["retry-after"]) >= 1


def test_redis_limits_are_shared_by_instances(postgres_backend):
    backend = postgres_backend
    with TestClient(backend.app()) as a, TestClient(backend.app()) as b:
        admin = {"authorization": "Bearer test-admin-token"}
        tenant = f"shared-{secrets.token_hex(3)}"
        a.post("/admin/api/tenants", json={"name": tenant}, headers=admin)
        key = a.post(f"/admin/api/tenants/{tenant}/keys", json={"rpm_limit": 2}, headers=admin).json()["key"]
        body = {"model": "synthetic:tiny", "prompt": "x", "max_tokens": 1}
        auth = {"authorization": f"Bearer {key}"}
        assert a.post("/v1/completions", json=body, headers=auth).status_code == 200
        assert b.post("/v1/completions", json=body, headers=auth).status_code == 200
        assert a.post("/v1/completions", json=body, headers=auth).status_code == 429
        assert b.post("/v1/completions", json=body, headers=auth).status_code == 429


@pytest.mark.parametrize("fail_open", [False, True])
def test_redis_down_is_fail_closed_unless_configured(postgres_backend, fail_open):
    backend = postgres_backend
    with TestClient(backend.app()) as up:
        admin = {"authorization": "Bearer test-admin-token"}
        tenant = f"down-{secrets.token_hex(3)}"
        up.post("/admin/api/tenants", json={"name": tenant}, headers=admin)
        limited = up.post(f"/admin/api/tenants/{tenant}/keys", json={"rpm_limit": 100}, headers=admin).json()["key"]
    app = backend.app(redis_url="redis://127.0.0.1:1/0", rate_limit_fail_open=fail_open)
    with TestClient(app) as down:
        r = down.post("/v1/completions", json={"model": "synthetic:tiny", "prompt": "x", "max_tokens": 1},
                      headers={"authorization": f"Bearer {limited}"})
        if fail_open:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "rate_limiter_unavailable" and "Redis" in r.json()["error"]["message"]
        assert down.get("/ready").status_code == 503


async def _scenario(limiter, subject: str) -> list:
    """The same sequence of operations; returns what each decision said."""
    limits = Limits(rpm=3, tpm=100)
    out = []
    for tokens in (40, 40, 40):
        d = await limiter.acquire(subject, limits, tokens)
        out.append((d.allowed, d.refused, d.requests.remaining, d.tokens.remaining, d.reserved_tokens))
    await limiter.settle(subject, limits, 40, 10)  # 30 tokens come back
    d = await limiter.acquire(subject, limits, 40)
    out.append((d.allowed, d.refused, d.requests.remaining, d.tokens.remaining, d.reserved_tokens))
    d = await limiter.acquire(subject, limits, 1)
    out.append((d.allowed, d.refused, d.requests.remaining, d.retry_after_s > 0))
    big = await limiter.acquire(subject + "-big", Limits(tpm=100), 10_000)
    out.append((big.allowed, big.reserved_tokens))  # capped at the limit, so it can run on an idle key
    return out


def test_lua_scripts_agree_with_the_in_process_store(redis_prefix):
    async def both():
        redis = RedisRateLimiter.from_url(REDIS_URL, prefix=redis_prefix)
        try:
            return await _scenario(redis, "parity"), await _scenario(MemoryRateLimiter(), "parity")
        finally:
            await redis.close()

    shared, local = run(both())
    assert shared == local
    assert [s[:2] for s in shared[:5]] == [(True, None), (True, None), (False, "tokens"), (True, None),
                                          (False, "requests")]


def test_concurrent_admissions_are_atomic(redis_prefix):
    async def burst():
        limiters = [RedisRateLimiter.from_url(REDIS_URL, prefix=redis_prefix) for _ in range(4)]
        try:
            decisions = await asyncio.gather(*(limiters[i % 4].acquire("burst", Limits(rpm=5), 0)
                                               for i in range(40)))
        finally:
            for limiter in limiters:
                await limiter.close()
        return sum(d.allowed for d in decisions)

    assert run(burst()) == 5
