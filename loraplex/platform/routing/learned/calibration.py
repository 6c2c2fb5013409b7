"""Thresholds for a traffic share (RouteLLM's calibration), and the shares models actually got.

- The pool's models, least capable first (by their auto_max_complexity now, then name), each get a
  share of traffic (shares sum to 1); a model's threshold is the score quantile at the shares of
  it and every model below it, over the scores `auto` recorded in the window (usage_ledger's
  route_score). The most capable model's threshold is 1: it takes the rest.
- `--strong-share X` alone: the most capable model gets X and the others split the rest evenly.
- At most MAX_SCORES of the window's newest scores are read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.billing.tables import usage_ledger
from loraplex.billing.usage import utcnow
from loraplex.platform.errors import invalid
from loraplex.platform.tenancy import catalog

MAX_SCORES = 1_000_000
MAX_WINDOW = timedelta(days=366)
_DURATION = re.compile(r"^\s*(\d{1,6})\s*([smhd])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


@dataclass(frozen=True)
class Calibration:
    thresholds: dict[str, float]  # model -> its new auto_max_complexity
    shares: dict[str, float]  # model -> the share asked for
    expected: dict[str, float]  # model -> the share the window's scores give it under the new thresholds
    scores: int  # how many scores the window held


def parse_window(raw: str) -> timedelta:
    """"7d", "24h", "30m", "90s" -> timedelta (1 s .. 366 d)."""
    m = _DURATION.match(raw or "")
    value = timedelta(**{_UNITS[m.group(2)]: int(m.group(1))}) if m else None
    if value is None or not timedelta(seconds=1) <= value <= MAX_WINDOW:
        raise invalid(f"since must be a duration like 7d, 24h or 30m, up to 366d, got {raw!r}", "since")
    return value


def shares_for(pool: dict[str, float], strong_share: float | None, shares: dict[str, float] | None) -> dict[str, float]:
    """Each pool model's share, least capable first; `shares` names every model, or `strong_share`
    is the most capable one's (the rest split evenly)."""
    ranked = sorted(pool, key=lambda n: (pool[n], n))
    if len(ranked) < 2:
        raise invalid("calibration needs at least two models in auto's pool", "strong_share")
    if shares is not None:
        if set(shares) != set(ranked) or not all(0 <= v <= 1 for v in shares.values()) \
                or abs(sum(shares.values()) - 1) > 1e-6:
            raise invalid(f"shares must give each model of auto's pool ({', '.join(ranked)}) a share from 0 to 1, "
                          "summing to 1", "shares")
        return {n: float(shares[n]) for n in ranked}
    if strong_share is None or not 0 <= strong_share <= 1:
        raise invalid(f"strong_share must be a number from 0 to 1, got {strong_share!r}", "strong_share")
    rest = (1 - strong_share) / (len(ranked) - 1)
    return {**{n: rest for n in ranked[:-1]}, ranked[-1]: float(strong_share)}


def thresholds(scores: Sequence[float], shares: dict[str, float]) -> dict[str, float]:
    """Each model's threshold (shares least capable first): the score at or below which its share
    and the shares below it fall."""
    ordered = np.sort(np.clip(np.asarray(scores, np.float64), 0.0, 1.0))  # [N]
    if len(ordered) == 0:
        raise invalid("no `auto` request with a score was recorded in the window", "since")
    out, cumulative, floor = {}, 0.0, 0.0
    for name in list(shares)[:-1]:
        cumulative += shares[name]
        taken = int(round(cumulative * len(ordered)))
        floor = max(floor, 0.0 if taken == 0 else float(ordered[taken - 1]))  # never below the model under it
        out[name] = round(floor, 6)
    out[list(shares)[-1]] = 1.0
    return out


def expected_shares(scores: Sequence[float], limits: dict[str, float]) -> dict[str, float]:
    """The share of `scores` each model takes under `limits` (least capable first): the lowest limit
    at or above the score."""
    values = np.asarray(scores, np.float64)
    below, out = np.zeros(len(values), bool), {}
    for name, limit in limits.items():
        takes = (values <= limit) & ~below
        out[name] = float(takes.mean()) if len(values) else 0.0
        below |= takes
    return out


async def recorded_scores(session: AsyncSession, since: datetime) -> list[float]:
    """The newest MAX_SCORES route scores recorded since `since`."""
    rows = await session.execute(select(usage_ledger.c.route_score)
                                 .where(usage_ledger.c.route_score.is_not(None), usage_ledger.c.created_at >= since)
                                 .order_by(usage_ledger.c.created_at.desc()).limit(MAX_SCORES))
    return [float(r[0]) for r in rows]


def calibrate(pool: dict[str, float], scores: Sequence[float], strong_share: float | None = None,
              shares: dict[str, float] | None = None) -> Calibration:
    wanted = shares_for(pool, strong_share, shares)
    limits = thresholds(scores, wanted)
    return Calibration(limits, wanted, expected_shares(scores, limits), len(scores))


async def calibrate_pool(session: AsyncSession, window: timedelta, strong_share: float | None = None,
                         shares: dict[str, float] | None = None, apply: bool = True) -> Calibration:
    """Calibrates auto's pool over the window's recorded scores and (apply) sets its thresholds."""
    pool = await catalog.auto_models(session)
    scores = await recorded_scores(session, utcnow() - window)
    result = calibrate(pool, scores, strong_share, shares)
    if apply:
        for name, limit in result.thresholds.items():
            await catalog.set_auto_route(session, name, limit)
    return result


async def daily_shares(session: AsyncSession, since: datetime) -> list[dict]:
    """[{day, model, requests, share}] of the requests `auto` routed since `since`, per UTC day."""
    day = func.date(usage_ledger.c.created_at)
    rows = (await session.execute(
        select(day, usage_ledger.c.model, func.count())
        .where(usage_ledger.c.routed_from.is_not(None), usage_ledger.c.route_score.is_not(None),
               usage_ledger.c.created_at >= since)
        .group_by(day, usage_ledger.c.model).order_by(day, usage_ledger.c.model))).all()
    totals: dict[str, int] = {}
    for d, _, n in rows:
        totals[str(d)] = totals.get(str(d), 0) + n
    return [{"day": str(d), "model": m, "requests": n, "share": round(n / totals[str(d)], 4)} for d, m, n in rows]
