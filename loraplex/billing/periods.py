"""Time periods, all in UTC: the periods of budgets (a day, a month, or all time) and of exports
(a month, a day, or an inclusive range of days).

Budget counters are named by period id (`d20261105`, `m202611`, `all`), so a request charges the
periods it arrived in even when it finishes after midnight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

BUDGET_PERIODS = ("day", "month", "total")
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


def check_budget_period(period: str) -> str:
    if period not in BUDGET_PERIODS:
        raise PeriodError(f"period must be one of {', '.join(BUDGET_PERIODS)}, got {period!r}")
    return period


def period_id(period: str, at: datetime) -> str:
    """The counter name of the `period` that contains `at`."""
    at = utc(at)
    if period == "day":
        return f"d{at:%Y%m%d}"
    if period == "month":
        return f"m{at:%Y%m}"
    return "all"


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
    end = date(year + 1, 1, 1) if month == 12 else date(year, month + 1, 1)
    return DateRange(start, end)


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
