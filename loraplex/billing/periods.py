"""Time periods, all in UTC: the periods of budgets (registered here, each one `BudgetPeriod`) and
of exports (a month, a day, or an inclusive range of days).

- A budget period is whole UTC days (so the daily rollups can rebuild its counter) and names its
  counters by period id (`d20261105`, `w2026W45`, `m202611`, `all`): a request charges the periods
  it arrived in even when it finishes after midnight.
- Adding a period is one `BudgetPeriod` in BUDGET_PERIODS plus a migration that widens the
  budgets table's CHECK (its ORM model reads the names from here).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

_MONTH = re.compile(r"([0-9]{4})-([0-9]{2})")  # ASCII digits, matched whole
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_SHAPE = "period must be YYYY-MM, YYYY-MM-DD or YYYY-MM-DD..YYYY-MM-DD"
MAX_PERIOD_CHARS = 32


class PeriodError(ValueError):
    """A period the user typed that is not one we understand."""

    def __init__(self, message: str, param: str = "period"):
        super().__init__(message)
        self.param = param


def utc(value: datetime) -> datetime:
    """Aware and in UTC (SQLite hands back naive datetimes, which are UTC by convention)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _next_month(day: date) -> date:
    return date(day.year + 1, 1, 1) if day.month == 12 else date(day.year, day.month + 1, 1)


@dataclass(frozen=True)
class BudgetPeriod:
    """One budget period: its name (API, CLI, database), how its counters are named, and which UTC
    days make the period that contains a given day."""

    name: str
    label: str  # for people: "UTC day", "ISO week (UTC, from Monday)"
    first_day: Callable[[date], date | None]  # of the period holding a day; None: it has no start
    next_first_day: Callable[[date], date | None]  # the day after it ends; None: it never ends
    id_of: Callable[[date], str]  # the counter id of the period holding a day

    def period_id(self, at: datetime) -> str:
        return self.id_of(utc(at).date())

    def start(self, at: datetime) -> datetime | None:
        """When the period that contains `at` began (None: all time)."""
        first = self.first_day(utc(at).date())
        return None if first is None else datetime.combine(first, time(), UTC)

    def end(self, at: datetime) -> datetime | None:
        """When the period that contains `at` ends, exclusive (None: never)."""
        after = self.next_first_day(utc(at).date())
        return None if after is None else datetime.combine(after, time(), UTC)


def _monday(day: date) -> date:
    return day - timedelta(days=day.weekday())


def _week_id(day: date) -> str:
    year, week, _ = day.isocalendar()
    return f"w{year}W{week:02d}"


BUDGET_PERIODS: dict[str, BudgetPeriod] = {p.name: p for p in (
    BudgetPeriod("day", "UTC day", lambda d: d, lambda d: d + timedelta(days=1), lambda d: f"d{d:%Y%m%d}"),
    BudgetPeriod("week", "ISO week (UTC, from Monday)", _monday, lambda d: _monday(d) + timedelta(days=7),
                 _week_id),
    BudgetPeriod("month", "UTC month", lambda d: d.replace(day=1), _next_month, lambda d: f"m{d:%Y%m}"),
    BudgetPeriod("total", "all time", lambda d: None, lambda d: None, lambda d: "all"),
)}
DEFAULT_BUDGET_PERIOD = "month"


def budget_period(name: object) -> BudgetPeriod:
    """The period called `name`; PeriodError for anything else (bounded in the message)."""
    found = BUDGET_PERIODS.get(name) if isinstance(name, str) else None
    if found is None:
        shown = repr(name)[:40]
        raise PeriodError(f"period must be one of {', '.join(BUDGET_PERIODS)}, got {shown}")
    return found


def check_budget_period(period: str) -> str:
    return budget_period(period).name


def period_id(period: str, at: datetime) -> str:
    """The counter id of the `period` that contains `at`."""
    return budget_period(period).period_id(at)


@dataclass(frozen=True)
class DateRange:
    """Whole UTC days [start, end)."""

    start: date
    end: date

    @property
    def start_at(self) -> datetime:
        return datetime.combine(self.start, time(), UTC)

    @property
    def end_at(self) -> datetime:
        return datetime.combine(self.end, time(), UTC)

    @property
    def last_day(self) -> date:
        return self.end - timedelta(days=1)


def _day(text: str) -> date:
    if not _DAY.fullmatch(text):
        raise PeriodError(f"{_SHAPE}, got {text!r}")
    try:
        day = date.fromisoformat(text)
    except ValueError as exc:
        raise PeriodError(f"period: {text!r} is not a date ({exc})") from None
    if day == date.max:  # its range would end on the day after, which no date can hold
        raise PeriodError(f"period: {text!r} is past the last day a period may cover")
    return day


def month_range(year: int, month: int) -> DateRange:
    start = date(year, month, 1)
    return DateRange(start, _next_month(start))


def parse_period(text: str) -> DateRange:
    """`YYYY-MM` (a month), `YYYY-MM-DD` (a day) or `YYYY-MM-DD..YYYY-MM-DD` (inclusive), years
    0001 to 9999 (a range ending on 9999-12-31 is refused: its end, the day after, is no date)."""
    text = (text or "").strip()
    if len(text) > MAX_PERIOD_CHARS:
        raise PeriodError(f"{_SHAPE}, got {len(text)} characters")
    month = _MONTH.fullmatch(text)
    if month:
        year, number = int(month.group(1)), int(month.group(2))
        if not 1 <= number <= 12 or not 1 <= year <= 9999 or (year, number) == (9999, 12):
            raise PeriodError(f"period: {text!r} is not a month (YYYY-MM, 0001-01 to 9999-11)")
        return month_range(year, number)
    first, sep, last = text.partition("..")
    start = _day(first) if first else None
    if start is None:
        raise PeriodError(f"{_SHAPE}, got {text!r}")
    end = _day(last) if sep else start
    if end < start:
        raise PeriodError(f"period: {text!r} ends before it starts")
    return DateRange(start, end + timedelta(days=1))


def current_month(now: datetime) -> DateRange:
    now = utc(now)
    return month_range(now.year, now.month)
