"""The budget periods as objects: each one's counter id, start and end around its boundaries (ISO
weeks across a year end, months across December, leap days), the registry's checks of names, and
the counters a request charges."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from loraplex.billing.budgets import BudgetError, BudgetRule, counter_names
from loraplex.billing.periods import BUDGET_PERIODS, PeriodError, budget_period, period_id


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_every_period_names_its_counter_and_bounds():
    now = at("2026-11-05T13:30:00")  # a Thursday
    seen = {p.name: (p.period_id(now), p.start(now), p.end(now)) for p in BUDGET_PERIODS.values()}
    assert seen == {
        "day": ("d20261105", at("2026-11-05T00:00"), at("2026-11-06T00:00")),
        "week": ("w2026W45", at("2026-11-02T00:00"), at("2026-11-09T00:00")),
        "month": ("m202611", at("2026-11-01T00:00"), at("2026-12-01T00:00")),
        "total": ("all", None, None),
    }
    for p in BUDGET_PERIODS.values():
        assert p.label and p.name == budget_period(p.name).name


@pytest.mark.parametrize(("moment", "week", "monday"), [
    ("2026-11-08T23:59:59.999999", "w2026W45", "2026-11-02"),  # Sunday's last instant
    ("2026-11-09T00:00:00", "w2026W46", "2026-11-09"),  # Monday's first
    ("2026-12-31T12:00:00", "w2026W53", "2026-12-28"),  # 2026 has 53 ISO weeks
    ("2027-01-03T12:00:00", "w2026W53", "2026-12-28"),  # ... and its last one ends in 2027
    ("2027-01-04T00:00:00", "w2027W01", "2027-01-04"),
    ("2024-12-30T00:00:00", "w2025W01", "2024-12-30"),  # ISO year 2025 starts in December 2024
])
def test_weeks_are_iso_weeks_from_monday_in_utc(moment, week, monday):
    period = BUDGET_PERIODS["week"]
    assert period.period_id(at(moment)) == week
    assert period.start(at(moment)) == at(f"{monday}T00:00")
    assert period.end(at(moment)) - period.start(at(moment)) == timedelta(days=7)


def test_times_in_other_zones_count_in_utc():
    tokyo = timezone(timedelta(hours=9))
    monday_morning_in_tokyo = datetime(2026, 11, 9, 8, 0, tzinfo=tokyo)  # still Sunday in UTC
    assert period_id("week", monday_morning_in_tokyo) == "w2026W45"
    assert period_id("day", datetime(2026, 11, 9, 8, 0)) == "d20261109"  # naive: UTC by convention


def test_months_and_days_across_their_boundaries():
    month = BUDGET_PERIODS["month"]
    assert month.end(at("2026-12-31T23:59:59")) == at("2027-01-01T00:00")
    assert month.period_id(at("2027-01-01T00:00")) == "m202701"
    assert BUDGET_PERIODS["day"].end(at("2028-02-28T10:00")) == at("2028-02-29T00:00")


@pytest.mark.parametrize("name", ["fortnight", "Week", "", None, 7, "w" * 100_000])
def test_unknown_periods_are_refused_with_a_short_message(name):
    with pytest.raises(PeriodError) as caught:
        budget_period(name)
    assert len(str(caught.value)) < 120 and "day, week, month, total" in str(caught.value)
    with pytest.raises(BudgetError) as refused:
        BudgetRule("tenant", name, 10).validate()
    assert refused.value.param == "period"


def test_a_request_charges_every_period_of_its_tenant_and_key():
    names = counter_names(7, at("2026-11-05T13:30"))
    assert names == ("t:d20261105", "t:w2026W45", "t:m202611", "t:all",
                     "k7:d20261105", "k7:w2026W45", "k7:m202611", "k7:all")
    assert BudgetRule("key", "week", 10).validate().counter(7, at("2026-11-08T23:00")) == "k7:w2026W45"
    assert BudgetRule("tenant", "week", 10).counter(7, at("2026-11-09T00:00")) == "t:w2026W46"
