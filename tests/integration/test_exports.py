"""Billing exports and the tenant's usage endpoint: invoice lines and per-request records whose
totals equal the ledger's sums to the last digit, byte-identical when repeated, a price change
applied from its effective time, periods' edges, one tenant only, and bad input refused."""

from __future__ import annotations

import csv
import io
import json
import secrets
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from loraplex.billing.ledger_db import write_events
from loraplex.billing.tables import usage_ledger
from loraplex.billing.usage import UsageEvent
from tests.integration.billing_support import ADMIN, new_tenant, with_db

PRICES = {  # effective from -> (input, cached input, output) per 1M tokens
    datetime(2031, 3, 1, tzinfo=UTC): ("1.5", "0.5", "6"),
    datetime(2031, 3, 16, 12, tzinfo=UTC): ("2.25", "0.125", "8.000001"),
}
TIMES = [datetime(2031, 2, 28, 23, 59, 59, 999999, tzinfo=UTC),  # before the period
         datetime(2031, 3, 1, tzinfo=UTC), datetime(2031, 3, 10, 8, 30, tzinfo=UTC),
         datetime(2031, 3, 16, 11, 59, 59, tzinfo=UTC), datetime(2031, 3, 16, 12, tzinfo=UTC),
         datetime(2031, 3, 31, 23, 59, 59, 999999, tzinfo=UTC),
         datetime(2031, 4, 1, tzinfo=UTC)]  # after it


@pytest.fixture(scope="module")
def billed(api):
    """Two tenants with usage in March 2031 (and around it) on a model with a price change."""
    client = api.client
    model = f"priced-{secrets.token_hex(3)}"
    assert client.post("/admin/api/models", json={"name": model}, headers=ADMIN).status_code == 201
    for start, (inp, cached, out) in PRICES.items():
        r = client.post("/admin/api/prices", headers=ADMIN, json={
            "model": model, "input_per_1m": inp, "cached_input_per_1m": cached, "output_per_1m": out,
            "currency": "EUR", "effective_from": start.isoformat()})
        assert r.status_code == 201, r.text
    tenants = [new_tenant(client, "invoice") for _ in range(2)]
    events = []
    for t, (name, tenant_id, key) in enumerate(tenants):
        for i, when in enumerate(TIMES):
            events.append(UsageEvent(
                request_id=f"req_export_{secrets.token_hex(8)}", tenant_id=tenant_id, tenant=name, key_id=1,
                key_prefix=key[:12], model=model, adapter="tuned" if i in (1, 4) else None, priority="standard",
                prompt_tokens=1000 + 37 * i + t, cached_tokens=13 * i, completion_tokens=301 + 7 * i, ttft_s=0.0125,
                latency_s=0.5, status="ok", finish_reason="stop", endpoint="/v1/chat/completions", created_at=when))
    with_db(api.backend.settings, lambda engine: write_events(engine, events))
    return model, tenants, events


def _export(api, **params) -> bytes:
    r = api.client.get("/admin/api/billing/export", params={"period": "2031-03", **params}, headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.content


def _csv(data: bytes) -> list[dict]:
    return list(csv.DictReader(io.StringIO(data.decode())))


def _cost(event: UsageEvent) -> Decimal:
    start = max(s for s in PRICES if s <= event.created_at)
    inp, cached, out = (Decimal(p) for p in PRICES[start])
    uncached = event.prompt_tokens - event.cached_tokens
    return (uncached * inp + event.cached_tokens * cached + event.completion_tokens * out) / 10**6


def _in_march(events, tenant_id=None):
    return [e for e in events if e.created_at.month == 3 and tenant_id in (None, e.tenant_id)]


def test_invoice_lines_split_at_the_price_change_and_reconcile_with_the_ledger(api, billed):
    model, tenants, events = billed
    (name, tenant_id, _), _ = tenants
    records = _csv(_export(api, tenant=name))
    lines = [r for r in records if r["record"] == "line"]
    assert [(r["adapter"], r["input_per_1m"]) for r in lines] == [("", "1.50"), ("", "2.25"), ("tuned", "1.50"),
                                                                 ("tuned", "2.25")]
    assert all(r["tenant"] == name and r["model"] == model and r["currency"] == "EUR" for r in lines)
    assert lines[1]["output_per_1m"] == "8.000001" and lines[0]["period_end"] == "2031-03-31"
    mine = _in_march(events, tenant_id)
    for line in lines:
        group = [e for e in mine if (e.adapter or "") == line["adapter"]
                 and (e.created_at >= datetime(2031, 3, 16, 12, tzinfo=UTC)) == (line["input_per_1m"] == "2.25")]
        assert int(line["requests"]) == len(group)
        assert int(line["output_tokens"]) == sum(e.completion_tokens for e in group)
        assert Decimal(line["amount"]) == sum(_cost(e) for e in group)
    (tenant_total,) = [r for r in records if r["record"] == "tenant_total"]
    (total,) = [r for r in records if r["record"] == "total"]
    assert Decimal(total["amount"]) == Decimal(tenant_total["amount"]) == sum(_cost(e) for e in mine)

    async def ledger_sums(engine):
        c = usage_ledger.c
        query = select(func.count(), func.sum(c.prompt_tokens - c.cached_tokens), func.sum(c.cached_tokens),
                       func.sum(c.completion_tokens), func.sum(c.cost_picos)).where(
            c.tenant_id == tenant_id, c.created_at >= datetime(2031, 3, 1, tzinfo=UTC),
            c.created_at < datetime(2031, 4, 1, tzinfo=UTC))
        async with engine.connect() as conn:
            return (await conn.execute(query)).one()

    count, uncached, cached, completion, picos = with_db(api.backend.settings, ledger_sums)
    assert (int(total["requests"]), int(total["input_tokens"]), int(total["cached_input_tokens"]),
            int(total["output_tokens"])) == (count, uncached, cached, completion)
    assert Decimal(total["amount"]) == Decimal(int(picos)).scaleb(-12)


def test_exports_repeat_byte_for_byte_and_csv_and_jsonl_agree(api, billed):
    _, tenants, events = billed
    for detail in (False, True):
        for fmt in ("csv", "jsonl"):
            first = _export(api, format=fmt, detail=str(detail).lower())
            assert first == _export(api, format=fmt, detail=str(detail).lower())
        as_csv = _csv(_export(api, detail=str(detail).lower()))
        as_json = [json.loads(line) for line in _export(api, format="jsonl", detail=str(detail).lower()).splitlines()]
        assert [{k: str(v) if v is not None else "" for k, v in r.items()} for r in as_json] == as_csv
    detail = _csv(_export(api, detail="true"))
    names = {t[0] for t in tenants}
    requests = [r for r in detail if r["record"] == "request" and r["tenant"] in names]
    assert sorted(r["request_id"] for r in requests) == sorted(e.request_id for e in _in_march(events))
    assert requests[0]["created_at"] == "2031-03-01T00:00:00.000000Z"


def test_a_date_range_takes_whole_days_and_one_tenant_sees_only_its_usage(api, billed):
    _, tenants, events = billed
    (name, tenant_id, key), (other, other_id, _) = tenants
    first_half = _csv(_export(api, period="2031-03-01..2031-03-15", tenant=name, detail="true"))
    assert [r["request_id"] for r in first_half if r["record"] == "request"] == \
        [e.request_id for e in events if e.tenant_id == tenant_id and datetime(2031, 3, 1, tzinfo=UTC)
         <= e.created_at < datetime(2031, 3, 16, tzinfo=UTC)]
    usage = api.client.get("/v1/usage", params={"period": "2031-03"}, headers={"authorization": f"Bearer {key}"})
    assert usage.status_code == 200, usage.text
    body = usage.json()
    assert body["tenant"] == name and body["period"] == {"start": "2031-03-01", "end": "2031-03-31"}
    assert sum(line["requests"] for line in body["lines"]) == len(_in_march(events, tenant_id))
    (total,) = body["totals"]
    assert Decimal(total["amount"]) == sum(_cost(e) for e in _in_march(events, tenant_id))
    assert other not in json.dumps(body)
    assert api.client.get("/v1/usage", params={"period": "2031-13"},
                          headers={"authorization": f"Bearer {key}"}).status_code == 400


@pytest.mark.parametrize(("params", "status", "param"), [
    ({"period": "2031-13"}, 400, "period"), ({"period": "2031-03-05..2031-03-01"}, 400, "period"),
    ({"period": "March"}, 400, "period"), ({"period": "2031-03", "format": "xml"}, 400, "format"),
    ({"period": "2031-03", "tenant": "nobody-here"}, 404, "tenant")])
def test_bad_export_requests_are_refused_before_any_output(api, params, status, param):
    r = api.client.get("/admin/api/billing/export", params=params, headers=ADMIN)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
