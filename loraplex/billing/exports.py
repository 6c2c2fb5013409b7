"""Billing records for a period: per-tenant invoice lines (from the daily rollups) or one record
per request (from the ledger), each followed by totals per currency.

Records are plain dicts in a fixed order with exact decimal text for money (money.py), sorted by
names and times only, so the same ledger gives the same records, and the same bytes once
rendered (export_format.py). Input tokens are the uncached prompt tokens; cached input tokens are
priced apart; a request is priced by the price in force at its arrival, so a price change inside
the period splits a model's usage into one line per price.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from loraplex.billing.money import micros_text, picos_text
from loraplex.billing.periods import DateRange, utc
from loraplex.billing.prices import Price, prices_by_id
from loraplex.billing.tables import usage_daily, usage_ledger

TOKENS = ("requests", "input_tokens", "cached_input_tokens", "output_tokens")
INVOICE_FIELDS = ("record", "period_start", "period_end", "tenant", "model", "adapter", "currency", *TOKENS,
                  "input_per_1m", "cached_input_per_1m", "output_per_1m", "amount")
DETAIL_FIELDS = ("record", "request_id", "created_at", "tenant", "key", "model", "adapter", "priority",
                 "routed_from", "endpoint", "status", "finish_reason", *TOKENS, "ttft_ms", "latency_ms", "currency",
                 "amount")


@dataclass(frozen=True)
class Directory:
    """Names for the ids in the ledger (the platform owns tenants and keys)."""

    tenants: Mapping[int, str]
    keys: Mapping[int, str] = field(default_factory=dict)

    def tenant(self, tenant_id: int) -> str:
        return self.tenants.get(tenant_id, f"tenant-{tenant_id}")

    def key(self, key_id: int) -> str:
        return self.keys.get(key_id, f"key-{key_id}")


class Totals:
    """Sums per (tenant, currency) and per currency, as records."""

    def __init__(self) -> None:
        self._sums: dict[tuple[str, str], list[int]] = {}

    def add(self, tenant: str, currency: str, counts: tuple[int, ...], picos: int) -> None:
        for key in ((tenant, currency), ("", currency)):
            acc = self._sums.setdefault(key, [0] * (len(counts) + 1))
            for i, value in enumerate((*counts, picos)):
                acc[i] += value

    def records(self, base: dict, per_tenant: bool) -> list[dict]:
        """Tenant totals (if asked) by tenant, then the totals per currency."""
        out = []
        for (tenant, currency), (*counts, picos) in sorted(self._sums.items(), key=lambda kv: (not kv[0][0], kv[0])):
            if tenant and not per_tenant:
                continue
            kind = "tenant_total" if tenant else "total"
            out.append({**base, "record": kind, "tenant": tenant, "currency": currency,
                        **dict(zip(TOKENS, counts, strict=True)), "amount": picos_text(picos)})
        return out


def _counts(requests: int, prompt: int, cached: int, completion: int) -> tuple[int, int, int, int]:
    return int(requests), int(prompt) - int(cached), int(cached), int(completion)


def _price_fields(price: Price | None) -> dict:
    if price is None:
        return {"currency": "", "input_per_1m": "", "cached_input_per_1m": "", "output_per_1m": ""}
    return {"currency": price.currency, "input_per_1m": micros_text(price.input_micros),
            "cached_input_per_1m": micros_text(price.cached_input_micros),
            "output_per_1m": micros_text(price.output_micros)}


def _period_fields(period: DateRange) -> dict:
    return {"period_start": period.start.isoformat(), "period_end": period.last_day.isoformat()}


async def invoice_lines(conn: AsyncConnection, period: DateRange, names: Directory,
                        tenant_id: int | None = None) -> list[dict]:
    """One line per tenant, model, adapter and price, then tenant totals and totals per currency."""
    d = usage_daily.c
    query = (select(d.tenant_id, d.model, d.adapter, d.price_id, func.sum(d.requests), func.sum(d.prompt_tokens),
                    func.sum(d.cached_tokens), func.sum(d.completion_tokens), func.sum(d.cost_picos))
             .where(d.day >= period.start, d.day < period.end).group_by(d.tenant_id, d.model, d.adapter, d.price_id))
    if tenant_id is not None:
        query = query.where(d.tenant_id == tenant_id)
    rows = (await conn.execute(query)).all()
    book = await prices_by_id(conn, (r.price_id for r in rows))
    base = dict.fromkeys(INVOICE_FIELDS, "") | _period_fields(period)
    lines, totals = [], Totals()
    for tid, model, adapter, price_id, requests, prompt, cached, completion, picos in rows:
        price = book.get(price_id)
        counts = _counts(requests, prompt, cached, completion)
        line = {**base, "record": "line", "tenant": names.tenant(tid), "model": model, "adapter": adapter,
                **_price_fields(price), **dict(zip(TOKENS, counts, strict=True)), "amount": picos_text(int(picos))}
        since = price.effective_from.isoformat() if price else ""
        lines.append((line["tenant"], model, adapter, line["currency"], since, price_id, line))
        totals.add(line["tenant"], line["currency"], counts, int(picos))
    lines.sort(key=lambda item: item[:-1])
    return [item[-1] for item in lines] + totals.records(base, per_tenant=True)


def _detail(row, names: Directory) -> tuple[dict, tuple[int, ...]]:
    counts = _counts(1, row.prompt_tokens, row.cached_tokens, row.completion_tokens)
    return {
        "record": "request", "request_id": row.request_id,
        "created_at": utc(row.created_at).strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "tenant": names.tenant(row.tenant_id),
        "key": names.key(row.key_id), "model": row.model, "adapter": row.adapter or "", "priority": row.priority,
        "routed_from": row.routed_from or "", "endpoint": row.endpoint, "status": row.status,
        "finish_reason": row.finish_reason or "", **dict(zip(TOKENS, counts, strict=True)), "ttft_ms": row.ttft_ms,
        "latency_ms": row.latency_ms, "currency": row.currency or "", "amount": picos_text(row.cost_picos or 0),
    }, counts


async def request_records(conn: AsyncConnection, period: DateRange, names: Directory,
                          tenant_id: int | None = None) -> AsyncIterator[dict]:
    """Every request of the period in arrival order, then totals per currency."""
    query = (select(usage_ledger).where(usage_ledger.c.created_at >= period.start_at,
                                        usage_ledger.c.created_at < period.end_at)
             .order_by(usage_ledger.c.created_at, usage_ledger.c.request_id))
    if tenant_id is not None:
        query = query.where(usage_ledger.c.tenant_id == tenant_id)
    totals = Totals()
    result = await conn.stream(query.execution_options(yield_per=1000))
    async for row in result:
        record, counts = _detail(row, names)
        totals.add(record["tenant"], record["currency"], counts, row.cost_picos or 0)
        yield record
    for record in totals.records(dict.fromkeys(DETAIL_FIELDS, ""), per_tenant=False):
        yield record
