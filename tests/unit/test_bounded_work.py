"""Work and memory that tenant input cannot blow up: the complexity score's regexes run in linear
time over at most SCAN_CHARS, the caches keep only what exists and drop the oldest, refused keys
are remembered in a small bounded cache of their own, period and name checks match whole."""

from __future__ import annotations

import asyncio
import time

import pytest

from loraplex.billing.periods import PeriodError, parse_period
from loraplex.platform.auth import Refusals
from loraplex.platform.cache import RefreshingCache
from loraplex.platform.errors import PlatformError
from loraplex.platform.openai.schemas import too_deep
from loraplex.platform.openai.tool_auto import parse_calls
from loraplex.platform.routing import complexity
from loraplex.platform.routing.complexity import SCAN_CHARS, RequestText, score
from loraplex.platform.tenancy.common import check_name

HOSTILE_TEXTS = {
    "newlines and spaces": "\n " * 16_000,
    "spaces": " " * 32_000,
    "indented semicolons": (" " * 50 + "; x") * 2_000,
    "one long line of equations": "a = (" + " " * 30_000 + "1 + 1",
    "1 MB of mixed whitespace and code": ("\n \t" * 100 + "x = 1;" + " " * 200 + "- item?") * 3_000,
}


@pytest.mark.parametrize("text", HOSTILE_TEXTS.values(), ids=HOSTILE_TEXTS.keys())
def test_scoring_is_fast_whatever_the_text(text):
    start = time.perf_counter()
    score(RequestText(text, len(text), max_tokens=64))
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text", HOSTILE_TEXTS.values(), ids=HOSTILE_TEXTS.keys())
def test_each_pattern_runs_in_linear_time_on_the_whole_text(text):
    """Not only the score's first SCAN_CHARS: each pattern over 200K characters of the hostile text."""
    text = (text * (200_000 // len(text) + 1))[:200_000]
    for pattern in (complexity._CODE_LINE, complexity._ASK, complexity._EQUATION, complexity._LATEX,
                    complexity._REASONING, complexity._WORD):
        start = time.perf_counter()
        pattern.findall(text)
        assert time.perf_counter() - start < 2.0, pattern.pattern


def test_only_scan_chars_of_a_long_turn_are_read():
    """The first and last SCAN_CHARS / 2: a code fence just past the first half is not seen."""
    ask = "Explain why, step by step, and compare the trade-off."
    fence_at = SCAN_CHARS // 2 + 1000
    padded = ask + " filler" * (fence_at // 7) + " ```" + " filler" * 200_000 + " Why?"
    signals = score(RequestText(padded, len(padded))).signals
    assert signals["code"] == 0.0 and signals["reasoning"] == 1.0 and signals["multipart"] == 0.0
    short = ask + " ``` Why?"
    assert score(RequestText(short, len(short))).signals["code"] == 1.0


def test_the_code_and_ask_signals_still_read_lines():
    code = "def f(x):\n    return x\nclass A:\n    pass\n"
    assert score(RequestText(code, len(code))).signals["code"] == 1.0
    asks = "1. first\n2. second\n  3. third\n- fourth\n* fifth"
    assert score(RequestText(asks, len(asks))).signals["multipart"] == 1.0


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_cache_keeps_no_misses_and_drops_the_oldest():
    loads = []

    async def load(key: str) -> str | None:
        loads.append(key)
        return None if key.startswith("missing") else key.upper()

    async def scenario():
        clock = Clock()
        cache = RefreshingCache(load, 10.0, what="t", grace_s=60.0, max_entries=3, clock=clock,
                                keep=lambda v: v is not None)
        assert await cache.get("a") == "A"
        for i in range(1000):
            assert await cache.get(f"missing{i}") is None
        assert len(cache) == 1  # misses are answered, not stored
        for key in "bcd":
            await cache.get(key)
        assert len(cache) == 3 and await cache.get("d") == "D"
        loads.clear()
        await cache.get("a")  # the oldest went first
        assert loads == ["a"]
        clock.now += 61  # past TTL and grace: dropped as the next entry is stored
        await cache.get("e")
        assert len(cache) == 1

    asyncio.run(scenario())


def test_refusals_are_bounded_and_expire():
    clock = Clock()
    refusals = Refusals(0.5, 100, clock)
    for i in range(100_000):
        refusals.add(f"h{i}", "Incorrect API key provided.")
    assert len(refusals) == 100 and refusals.get("h99999") and refusals.get("h0") is None
    clock.now += 0.5
    assert refusals.get("h99999") is None


def test_nesting_is_measured_without_recursion():
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    assert too_deep(deep) and not too_deep([[[1]]], 3) and too_deep([[[1]]], 2)
    assert not too_deep({"a": 1, "b": [1, 2]}) and not too_deep(None)


def test_an_auto_answer_nested_past_the_recursion_limit_is_content():
    assert parse_calls("[" * 50_000 + "]" * 50_000, frozenset({"f"})) is None
    assert parse_calls('```json\n{"name": "f", "arguments": {}}\n```', frozenset({"f"})) == [("f", "{}")]
    assert parse_calls("```" + " " * 100_000 + "x", frozenset({"f"})) is None


@pytest.mark.parametrize("period", ["0000-01", "9999-12", "9999-12-31", "2026-01-01..9999-12-31", "0000-01-01",
                                    "2026-1\uff11", "20261-01", "x" * 10_000])
def test_periods_out_of_range_are_period_errors(period):
    with pytest.raises(PeriodError):
        parse_period(period)


def test_the_calendars_edges_that_fit_are_periods():
    assert parse_period("0001-01").start.year == 1
    assert parse_period("9999-11").last_day.isoformat() == "9999-11-30"
    assert parse_period("9999-12-30").last_day.isoformat() == "9999-12-30"


@pytest.mark.parametrize("name", ["acme\n", "acme\r", " acme", "acme ", "ac me", "a" * 65, ""])
def test_names_are_matched_whole(name):
    with pytest.raises(PlatformError):
        check_name(name, "tenant")
    assert check_name("acme-1.x_y", "tenant") == "acme-1.x_y"
