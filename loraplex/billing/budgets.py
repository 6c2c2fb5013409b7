"""Token budgets and the counters they are checked against.

Every request charges a counter per budget period (periods.BUDGET_PERIODS) for its tenant and for its
key, whether or not a budget watches them. Keeping them all means a budget added in the
middle of a month starts from what was already used, without a rebuild. A budget is a limit on
one of those counters (and an optional soft limit that only raises an alert).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import date, datetime

from loraplex.billing.periods import BUDGET_PERIODS, PeriodError, budget_period, period_id, utc


class BudgetError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class BudgetRule:
    """A limit on the tokens (prompt + completion) of a tenant, or of one of its keys, per period."""

    scope: str  # "tenant" or "key"
    period: str  # a name in periods.BUDGET_PERIODS
    limit_tokens: int
    soft_limit_tokens: int | None = None

    def validate(self) -> BudgetRule:
        if self.scope not in ("tenant", "key"):
            raise BudgetError(f"scope must be tenant or key, got {self.scope!r}", "scope")
        try:
            budget_period(self.period)
        except PeriodError as exc:
            raise BudgetError(str(exc), "period") from None
        if not _positive(self.limit_tokens):
            raise BudgetError(f"limit_tokens must be a positive integer, got {self.limit_tokens!r}", "limit_tokens")
        soft = self.soft_limit_tokens
        if soft is not None and (not _positive(soft) or soft > self.limit_tokens):
            raise BudgetError(f"soft_limit_tokens must be a positive integer no larger than limit_tokens "
                              f"({self.limit_tokens}), got {soft!r}", "soft_limit_tokens")
        return self

    def counter(self, key_id: int, at: datetime) -> str:
        return counter_name("t" if self.scope == "tenant" else f"k{key_id}", self.period, at)


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def counter_name(scope: str, period: str, at: datetime) -> str:
    return f"{scope}:{period_id(period, at)}"


def counter_names(key_id: int, at: datetime) -> tuple[str, ...]:
    """The counters a request arriving at `at` charges: tenant and key, each budget period."""
    return _names(key_id, utc(at).date())


@functools.lru_cache(maxsize=4096)  # on every request; the names change once a day per key
def _names(key_id: int, day: date) -> tuple[str, ...]:
    at = datetime(day.year, day.month, day.day)
    return tuple(counter_name(scope, period, at) for scope in ("t", f"k{key_id}") for period in BUDGET_PERIODS)


def limits_for(counters: tuple[str, ...], rules: tuple[BudgetRule, ...], key_id: int,
               at: datetime) -> tuple[int, ...]:
    """Each counter's limit (0: none); with several rules on one counter the smallest wins."""
    limits = dict.fromkeys(counters, 0)
    for rule in rules:
        name = rule.counter(key_id, at)
        if name in limits:
            limits[name] = min(limits[name] or rule.limit_tokens, rule.limit_tokens)
    return tuple(limits[c] for c in counters)
