"""The price list: per model, prices per 1M input, cached input and output tokens, from a time on.

Prices are append-only and never start in the past: a ledger row is priced when it is written,
with the price in force at the request's arrival, so a price that reached back would disagree
with rows already billed. To change a price, add one with a later `effective_from`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import insert, select

from loraplex.billing.money import MoneyError, check_currency, micros_text, parse_price
from loraplex.billing.periods import utc
from loraplex.billing.tables import prices
from loraplex.billing.usage import utcnow

# How far in the past an effective_from may be: it absorbs the clock skew between the client
# that chose "now" and this process, and is far shorter than any flush of the ledger writer.
PAST_TOLERANCE = timedelta(seconds=1)


@dataclass(frozen=True)
class Price:
    id: int
    model: str
    currency: str
    input_micros: int
    cached_input_micros: int
    output_micros: int
    effective_from: datetime

    def cost_picos(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """Exact: tokens x micro-units per 1M tokens is the cost in 10^-12 of the currency."""
        uncached = max(0, prompt_tokens - cached_tokens)
        return (uncached * self.input_micros + cached_tokens * self.cached_input_micros
                + completion_tokens * self.output_micros)

    def as_json(self) -> dict:
        return {"id": self.id, "model": self.model, "currency": self.currency,
                "input_per_1m": micros_text(self.input_micros),
                "cached_input_per_1m": micros_text(self.cached_input_micros),
                "output_per_1m": micros_text(self.output_micros),
                "effective_from": utc(self.effective_from).isoformat()}


def _price(row) -> Price:
    return Price(row.id, row.model, row.currency, row.input_micros, row.cached_input_micros, row.output_micros,
                 utc(row.effective_from))


@dataclass(frozen=True)
class PriceSpec:
    """A price as typed by an operator, validated into integers by `parse`."""

    model: str
    input_per_1m: object
    cached_input_per_1m: object
    output_per_1m: object
    currency: str = "USD"
    effective_from: datetime | None = None

    def parse(self, now: datetime) -> dict:
        start = utc(self.effective_from) if self.effective_from is not None else now
        if start < now - PAST_TOLERANCE:
            raise MoneyError("effective_from must not be in the past: requests already billed keep their price; "
                             "give a time from now on", "effective_from")
        return {"model": self.model, "currency": check_currency(self.currency),
                "input_micros": parse_price(self.input_per_1m, "input_per_1m"),
                "cached_input_micros": parse_price(self.cached_input_per_1m, "cached_input_per_1m"),
                "output_micros": parse_price(self.output_per_1m, "output_per_1m"),
                "effective_from": start, "created_at": now}


async def add_price(conn, spec: PriceSpec) -> Price:
    """Validates and inserts (the caller commits); raises MoneyError naming the bad field."""
    values = spec.parse(utcnow())
    row_id = (await conn.execute(insert(prices).values(**values).returning(prices.c.id))).scalar_one()
    return Price(row_id, **{k: v for k, v in values.items() if k != "created_at"})


async def list_prices(conn, model: str | None = None) -> list[Price]:
    query = select(prices).order_by(prices.c.model, prices.c.effective_from)
    if model is not None:
        query = query.where(prices.c.model == model)
    return [_price(r) for r in (await conn.execute(query)).all()]


async def prices_by_id(conn, ids: Iterable[int]) -> dict[int, Price]:
    wanted = sorted(set(ids) - {0})
    if not wanted:
        return {}
    rows = (await conn.execute(select(prices).where(prices.c.id.in_(wanted)))).all()
    return {r.id: _price(r) for r in rows}


class PriceBook:
    """The prices of some models, to find the one in force at a time."""

    def __init__(self, found: Iterable[Price]):
        self._by_model: dict[str, list[Price]] = {}
        for p in sorted(found, key=lambda p: (p.model, p.effective_from)):
            self._by_model.setdefault(p.model, []).append(p)
        self._starts = {m: [p.effective_from for p in ps] for m, ps in self._by_model.items()}

    @classmethod
    async def load(cls, conn, models: Iterable[str]) -> PriceBook:
        names = sorted(set(models))
        if not names:
            return cls([])
        rows = (await conn.execute(select(prices).where(prices.c.model.in_(names)))).all()
        return cls(_price(r) for r in rows)

    def at(self, model: str, when: datetime) -> Price | None:
        starts = self._starts.get(model)
        if not starts:
            return None
        i = bisect.bisect_right(starts, utc(when))
        return self._by_model[model][i - 1] if i else None
