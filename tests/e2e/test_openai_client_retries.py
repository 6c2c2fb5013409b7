"""The official `openai` client's retries against the real server: a budget 429 (insufficient_quota)
carries `x-should-retry: false`, so the client sends it once; a rate-limit 429 is still retried."""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest

from tests.e2e.server import admin_request, serving

ADMIN = "e2e-retries-admin"
MODEL = "synthetic:tiny"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("data"), ADMIN, args=("--demo",)) as srv:
        yield srv


def new_key(server, **limits) -> tuple[str, str]:
    """A new tenant and a key of it with these limits: (tenant, secret)."""
    tenant = f"retries-{secrets.token_hex(4)}"
    admin_request(server, ADMIN, "POST", "/tenants", json={"name": tenant})
    key = admin_request(server, ADMIN, "POST", f"/tenants/{tenant}/keys", json=limits).json()["key"]
    return tenant, key


def counted(server, name: str) -> float:
    """A counter's total over its labels, as the server's /metrics shows it."""
    text = httpx.get(f"{server.base_url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((f"{name}_total{{", f"{name}_total ")))


def retrying_client(server, key: str, statuses: list[int]) -> openai.OpenAI:
    """The client as users build it (two retries), recording the status of every attempt it makes."""
    hooks = {"response": [lambda response: statuses.append(response.status_code)]}
    return openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=2, timeout=60,
                         http_client=httpx.Client(event_hooks=hooks))


def test_a_budget_refusal_is_sent_once(server):
    tenant, key = new_key(server)
    admin_request(server, ADMIN, "POST", "/budgets", json={"tenant": tenant, "period": "total", "limit_tokens": 1})
    statuses: list[int] = []
    before = counted(server, "loraplex_budget_rejections")
    with pytest.raises(openai.RateLimitError) as refused:
        retrying_client(server, key, statuses).chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
    assert refused.value.code == "insufficient_quota"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert statuses == [429]  # the client's own record: one attempt
    assert counted(server, "loraplex_budget_rejections") - before == 1  # and the server saw one


def test_a_rate_limit_refusal_is_still_retried(server):
    _, key = new_key(server, rpm_limit=6)  # a bucket of 6 requests, one back every 10 s
    once = openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)
    for _ in range(7):  # the burst, then one over it
        try:
            once.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
        except openai.RateLimitError as refused:
            assert refused.code == "rate_limit_exceeded"
            assert "x-should-retry" not in refused.response.headers
            assert 0 < int(refused.response.headers["retry-after"]) <= 10
            break
    else:
        raise AssertionError("the seventh request within seconds was not refused")
    statuses: list[int] = []
    before = counted(server, "loraplex_rate_limit_rejections")
    reply = retrying_client(server, key, statuses).chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert statuses[0] == 429 and statuses[-1] == 200  # refused, waited retry-after, sent again
    assert counted(server, "loraplex_rate_limit_rejections") - before == statuses.count(429)
