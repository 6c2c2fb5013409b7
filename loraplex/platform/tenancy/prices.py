"""Prices of base models: billing keeps the list; here a price is checked against the catalog
(a price for a model nobody registered is a typo) and committed, or nothing is written."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.billing.money import MoneyError
from loraplex.billing.prices import Price, PriceSpec, add_price
from loraplex.platform.errors import invalid, not_found, shown
from loraplex.platform.tenancy.catalog import find_model
from loraplex.platform.tenancy.common import commit_or_conflict


async def set_price(session: AsyncSession, spec: PriceSpec) -> Price:
    if await find_model(session, spec.model) is None:
        raise not_found(f"model {shown(spec.model)!r} is not registered", "model", code="model_not_found")

    async def work() -> Price:
        try:
            return await add_price(session, spec)
        except MoneyError as exc:
            raise invalid(str(exc), exc.param) from None
        except OverflowError:  # a time at the edge of the calendar, in a zone that moves it past the edge
            raise invalid("effective_from is out of range", "effective_from") from None

    return await commit_or_conflict(session, f"a price for {spec.model!r} from that time", work)
