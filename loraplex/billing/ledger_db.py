"""One batch of usage events into the ledger, in one transaction.

`INSERT ... ON CONFLICT (request_id) DO NOTHING RETURNING id` writes the rows that are new; only
those are added to the daily rollups, in the same transaction, so a batch written twice (a spool
replayed after a crash) changes nothing the second time. The ids of rows that were already there
are looked up, so the caller learns the ledger id of every event it handed in.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from loraplex.billing.periods import utc
from loraplex.billing.prices import PriceBook
from loraplex.billing.tables import usage_daily, usage_ledger
from loraplex.billing.usage import UsageEvent

_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_picos")
_GRAIN = ("day", "tenant_id", "key_id", "model", "adapter", "price_id")


def _insert(conn: AsyncConnection, table):
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else max(0, round(seconds * 1000))


def ledger_row(event: UsageEvent, book: PriceBook) -> dict:
    price = book.at(event.model, event.created_at)
    return {
        "request_id": event.request_id, "created_at": utc(event.created_at), "tenant_id": event.tenant_id,
        "key_id": event.key_id, "model": event.model, "adapter": event.adapter, "priority": event.priority,
        "routed_from": event.routed_from, "route_score": event.route_score, "endpoint": event.endpoint[:32],
        "prompt_tokens": event.prompt_tokens,
        "cached_tokens": event.cached_tokens, "completion_tokens": event.completion_tokens,
        "ttft_ms": _ms(event.ttft_s), "latency_ms": _ms(event.latency_s) or 0, "status": event.status[:32],
        "finish_reason": event.finish_reason, "price_id": price.id if price else None,
        "currency": price.currency if price else None,
        "cost_picos": price.cost_picos(event.prompt_tokens, event.cached_tokens, event.completion_tokens)
        if price else None,
    }


def rollup_rows(rows: Sequence[dict]) -> list[dict]:
    """Ledger rows summed by the rollup grain, sorted so that concurrent writers lock in one order."""
    sums: dict[tuple, dict] = {}
    for r in rows:
        key = (r["created_at"].date(), r["tenant_id"], r["key_id"], r["model"], r["adapter"] or "",
               r["price_id"] or 0)
        acc = sums.setdefault(key, {**dict(zip(_GRAIN, key, strict=True)), **dict.fromkeys(_SUMS, 0)})
        acc["requests"] += 1
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            acc[name] += r[name]
        acc["cost_picos"] += r["cost_picos"] or 0
    return [sums[k] for k in sorted(sums)]


async def _add_rollups(conn: AsyncConnection, rows: Sequence[dict]) -> None:
    values = rollup_rows(rows)
    if not values:
        return
    stmt = _insert(conn, usage_daily)
    stmt = stmt.on_conflict_do_update(index_elements=list(_GRAIN),
                                      set_={n: usage_daily.c[n] + stmt.excluded[n] for n in _SUMS})
    await conn.execute(stmt, values)  # executemany: one cached statement, whatever the batch size


async def write_events(db: AsyncEngine, events: Sequence[UsageEvent]) -> dict[str, int]:
    """Writes the batch; returns request_id -> ledger id for every event (new or already there)."""
    unique = list({e.request_id: e for e in reversed(events)}.values())  # the first of any duplicate wins
    if not unique:
        return {}
    async with db.begin() as conn:
        book = await PriceBook.load(conn, {e.model for e in unique})
        rows = [ledger_row(e, book) for e in unique]
        stmt = (_insert(conn, usage_ledger).on_conflict_do_nothing(index_elements=["request_id"])
                .returning(usage_ledger.c.id, usage_ledger.c.request_id))
        ids = {rid: row_id for row_id, rid in (await conn.execute(stmt, rows)).all()}
        await _add_rollups(conn, [r for r in rows if r["request_id"] in ids])
        known = [r["request_id"] for r in rows if r["request_id"] not in ids]
        if known:
            query = select(usage_ledger.c.request_id, usage_ledger.c.id).where(usage_ledger.c.request_id.in_(known))
            ids.update({rid: row_id for rid, row_id in (await conn.execute(query)).all()})
    return ids
