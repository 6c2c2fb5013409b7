"""Bodies of the admin API's budget and price calls (msgspec structs), and row -> body conversions."""

from __future__ import annotations

from datetime import datetime

from msgspec import Struct

from loraplex.billing.prices import Price
from loraplex.platform.db.tables import Budget, as_utc


class BudgetIn(Struct, kw_only=True):
    """A budget of a tenant, or of its key with this display prefix, per day, month or in total."""

    tenant: str
    period: str
    limit_tokens: int
    soft_limit_tokens: int | None = None
    key: str | None = None


class BudgetOut(Struct):
    tenant: str
    key: str | None
    period: str
    limit_tokens: int
    soft_limit_tokens: int | None
    updated_at: datetime
    used_tokens: int  # in the current period, by the ledger
    counter_used_tokens: int | None  # the live counters (ledger + what is not written yet); None: unreachable
    counter_reserved_tokens: int | None  # held by requests in flight


class PriceIn(Struct, kw_only=True):
    """Prices per 1M tokens as decimal strings (or numbers), from `effective_from` (default now) on."""

    model: str
    input_per_1m: str | float | int
    cached_input_per_1m: str | float | int
    output_per_1m: str | float | int
    currency: str = "USD"
    effective_from: datetime | None = None


class PriceOut(Struct):
    id: int
    model: str
    currency: str
    input_per_1m: str
    cached_input_per_1m: str
    output_per_1m: str
    effective_from: str


class TenantPatch(Struct, kw_only=True):
    default_max_tokens: int | None


def budget_out(row: Budget, used: int, counter: tuple[int, int] | None) -> BudgetOut:
    return BudgetOut(row.tenant.name, row.key.prefix if row.key else None, row.period, row.limit_tokens,
                     row.soft_limit_tokens, as_utc(row.updated_at), used, counter[0] if counter else None,
                     counter[1] if counter else None)


def price_out(price: Price) -> PriceOut:
    return PriceOut(**price.as_json())
