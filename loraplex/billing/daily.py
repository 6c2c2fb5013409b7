"""Tokens and requests per UTC day over a span, from the daily rollups: what the admin UI charts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from loraplex.billing.tables import usage_daily


@dataclass(frozen=True)
class Day:
    day: date
    requests: int
    prompt_tokens: int
    completion_tokens: int


async def daily_totals(conn: AsyncConnection, first: date, last: date, tenant_id: int | None = None) -> list[Day]:
    """One entry per day from `first` to `last` inclusive (zeros where nothing was served), for one
    tenant or all of them."""
    d = usage_daily.c
    query = (select(d.day, func.sum(d.requests), func.sum(d.prompt_tokens), func.sum(d.completion_tokens))
             .where(d.day >= first, d.day <= last).group_by(d.day))
    if tenant_id is not None:
        query = query.where(d.tenant_id == tenant_id)
    found = {row[0]: row[1:] for row in (await conn.execute(query)).all()}
    days = [first + timedelta(days=i) for i in range((last - first).days + 1)]
    return [Day(day, *(int(v) for v in found.get(day, (0, 0, 0)))) for day in days]
