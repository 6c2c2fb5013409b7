"""What the ledger says a tenant has used, for rebuilding its counters.

The sums come from the daily rollups (written in the same transaction as the ledger rows) and
come with a high-water mark: the largest ledger id they include. On Postgres the read takes
`LOCK TABLE usage_ledger IN SHARE MODE`, which waits for batches being written and holds new
ones back, so every row with an id up to the mark is in the sums and every later row is not;
that is what lets a process tell, for each of its charges, whether the rebuild counted it.
(SQLite serializes writers and gives each reader one snapshot, which has the same effect.)
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import case, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from loraplex.billing.budgets import counter_name
from loraplex.billing.periods import BUDGET_PERIODS, utc
from loraplex.billing.tables import usage_daily, usage_ledger


def _tokens():
    return usage_daily.c.prompt_tokens + usage_daily.c.completion_tokens


def _sums_query(tenant_id: int, now: datetime):
    """Per key, the tokens of each budget period containing `now` (BUDGET_PERIODS' order): every
    period is whole UTC days, so the rollups since its first day are exactly its usage."""
    today = utc(now).date()
    tokens = _tokens()
    sums = []
    for period in BUDGET_PERIODS.values():
        first = period.first_day(today)
        sums.append(func.sum(tokens if first is None else case((usage_daily.c.day >= first, tokens), else_=0)))
    return (select(usage_daily.c.key_id, *sums)
            .where(usage_daily.c.tenant_id == tenant_id).group_by(usage_daily.c.key_id))


def counters_from_sums(rows, now: datetime) -> dict[str, int]:
    """(key id, then a sum per budget period) rows -> every counter of the tenant and its keys."""
    used: dict[str, int] = {}
    for key_id, *by_period in rows:
        for scope in ("t", f"k{key_id}"):
            for period, value in zip(BUDGET_PERIODS, by_period, strict=True):
                name = counter_name(scope, period, now)
                used[name] = used.get(name, 0) + int(value or 0)
    return used


async def tenant_usage(db: AsyncEngine, tenant_id: int, now: datetime,
                       fenced: bool = True) -> tuple[int, dict[str, int]]:
    """(high-water mark, counter -> tokens used) for the tenant's current periods at `now`.
    `fenced` False skips the lock (reports, where the mark does not matter)."""
    async with db.begin() as conn:
        if fenced and conn.dialect.name == "postgresql":
            await conn.execute(text("SET LOCAL lock_timeout = '10s'"))
            await conn.execute(text("LOCK TABLE usage_ledger IN SHARE MODE"))
        hwm = (await conn.execute(select(func.coalesce(func.max(usage_ledger.c.id), 0)))).scalar_one()
        rows = (await conn.execute(_sums_query(tenant_id, now))).all()
    return int(hwm), counters_from_sums(rows, now)


async def ledger_ids(db: AsyncEngine, request_ids: list[str]) -> dict[str, int]:
    """request_id -> ledger id of those already in the ledger."""
    found: dict[str, int] = {}
    async with db.connect() as conn:
        for i in range(0, len(request_ids), 1000):
            query = (select(usage_ledger.c.request_id, usage_ledger.c.id)
                     .where(usage_ledger.c.request_id.in_(request_ids[i:i + 1000])))
            found.update(dict((await conn.execute(query)).all()))
    return found
