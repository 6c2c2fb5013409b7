"""The wrong-admin-token limit per address, on a clock the test moves."""

from __future__ import annotations

import pytest

from loraplex.platform import auth_throttle
from loraplex.platform.auth_throttle import AdminAuthThrottle
from loraplex.platform.errors import PlatformError


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def locked_for(throttle: AdminAuthThrottle, address: str) -> int | None:
    try:
        throttle.check(address)
    except PlatformError as exc:
        assert exc.status == 429 and exc.code == "too_many_auth_failures"
        return int(exc.headers["retry-after"])
    return None


def test_the_limit_locks_until_the_oldest_failure_leaves_the_window():
    clock = Clock()
    t = AdminAuthThrottle(3, 60, clock)
    for _ in range(3):
        assert locked_for(t, "a") is None
        t.record("a", False)
        clock.now += 10
    assert locked_for(t, "a") == 30  # the first failure (at 1000) leaves the window at 1060; now 1030
    assert locked_for(t, "b") is None  # other addresses are not affected
    clock.now = 1060.5
    assert locked_for(t, "a") is None  # two failures left in the window: one more try
    t.record("a", False)
    assert locked_for(t, "a") == 10


def test_a_success_clears_the_count_and_zero_turns_it_off():
    clock = Clock()
    t = AdminAuthThrottle(2, 60, clock)
    t.record("a", False)
    t.record("a", True)
    t.record("a", False)
    assert locked_for(t, "a") is None
    off = AdminAuthThrottle(0, 60, clock)
    for _ in range(100):
        off.record("a", False)
    assert locked_for(off, "a") is None


def test_the_least_recently_failed_addresses_are_forgotten_first(monkeypatch):
    monkeypatch.setattr(auth_throttle, "MAX_ADDRESSES", 3)
    t = AdminAuthThrottle(1, 60, Clock())
    for address in "abcd":
        t.record(address, False)
    assert locked_for(t, "a") is None and all(locked_for(t, x) == 60 for x in "bcd")


@pytest.mark.parametrize("failures", [1, 5])
def test_retry_after_is_never_zero(failures):
    clock = Clock()
    t = AdminAuthThrottle(failures, 60, clock)
    for _ in range(failures):
        t.record("a", False)
    clock.now += 59.9
    assert locked_for(t, "a") == 1
