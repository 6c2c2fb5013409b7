"""A weekly budget end to end: set through the admin API of a server on real HTTP (create_app under
uvicorn in this process, so the test can hold the clock), charged by requests from OpenAI's client,
refused with 429 insufficient_quota when over, and rolled over to a fresh counter at Monday 00:00
UTC. The clock is billing.usage.utcnow's (every request's arrival time comes from it)."""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime

import httpx
import openai
import pytest

import loraplex.billing.usage as usage_clock
from loraplex.platform.app import create_app
from tests.integration.billing_support import ADMIN, PROMPT, ledger_rows, tokens
from tests.integration.live_app import serving

SUNDAY_NIGHT = datetime(2026, 11, 22, 23, 30, tzinfo=UTC)  # ISO week 2026-W47's last half hour
MONDAY = datetime(2026, 11, 23, 0, 0, tzinfo=UTC)  # 2026-W48 begins
LIMIT = 3 * (PROMPT + 8)  # three 8-token completions of "hello world" fit, a fourth reservation does not


class Clock:
    """What datetime.now answers inside billing.usage while a test runs."""

    at = SUNDAY_NIGHT


class _HeldDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return Clock.at.astimezone(tz) if tz else Clock.at.replace(tzinfo=None)


@pytest.fixture
def live(backend, monkeypatch):
    monkeypatch.setattr(usage_clock, "datetime", _HeldDatetime)
    monkeypatch.setattr(Clock, "at", SUNDAY_NIGHT)
    with serving(create_app(backend.settings, backend.engine)) as base:
        yield base


def admin(base: str, method: str, path: str, **body) -> httpx.Response:
    return httpx.request(method, f"{base}/admin/api{path}", json=body, timeout=60,
                         headers={"authorization": f"Bearer {ADMIN['authorization'].split()[1]}"})


def weekly(base: str, tenant: str) -> dict:
    listed = admin(base, "GET", f"/budgets?tenant={tenant}").json()
    return next(b for b in listed if b["period"] == "week")


def settled(base: str, tenant: str) -> dict:
    """The weekly budget once the ledger (written in batches) and the live counter agree."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        b = weekly(base, tenant)
        if b["counter_reserved_tokens"] == 0 and b["counter_used_tokens"] == b["used_tokens"]:
            return b
        time.sleep(0.1)
    raise AssertionError(f"the ledger and the counters never agreed: {b}")


def test_a_weekly_budget_refuses_over_it_and_starts_afresh_on_monday(live, backend):
    base = live
    tenant = f"weekly-{secrets.token_hex(4)}"
    made = admin(base, "POST", "/tenants", name=tenant)
    assert made.status_code == 201, made.text
    key = admin(base, "POST", f"/tenants/{tenant}/keys").json()["key"]
    set_ = admin(base, "POST", "/budgets", tenant=tenant, period="week", limit_tokens=LIMIT)
    assert set_.status_code == 200 and set_.json()["period"] == "week", set_.text
    client = openai.OpenAI(api_key=key, base_url=f"{base}/v1", max_retries=0, timeout=60)

    def complete():
        return client.completions.create(model="synthetic:tiny", prompt="hello world", max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})

    served = [complete() for _ in range(3)]
    assert all(a.usage.total_tokens == PROMPT + 8 for a in served)
    with pytest.raises(openai.RateLimitError) as refused:
        complete()
    error = refused.value.body
    assert error["code"] == error["type"] == "insufficient_quota" and "tenant week budget" in error["message"]

    sunday = settled(base, tenant)
    assert sunday["used_tokens"] == sum(a.usage.total_tokens for a in served) <= LIMIT

    Clock.at = MONDAY  # 2026-W48: a new counter, empty
    monday = complete()
    assert settled(base, tenant)["used_tokens"] == monday.usage.total_tokens
    rows = ledger_rows(backend.settings, made.json()["id"])
    assert [r.created_at.day for r in rows] == [22, 22, 22, 23] and tokens(rows) == LIMIT + PROMPT + 8
