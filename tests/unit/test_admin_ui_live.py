"""The live charts' arithmetic: percentiles from histogram bucket deltas between two readings, rates
per second, 429s by reason from the registry's samples, and a history that never grows past its span."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from loraplex.admin_ui.live import LiveHistory
from loraplex.admin_ui.live_metrics import OTHER_429, bucket_delta, percentile, point, read
from loraplex.engine.api import EngineStats, KVCacheStats, RequestStats

STATS = EngineStats(requests=RequestStats(running=1, waiting=2, waiting_by_class={"realtime": 2}),
                    kv=KVCacheStats(blocks_total=100, blocks_used=25, blocks_free=75))
INF = math.inf


def test_percentiles_interpolate_inside_the_bucket_that_holds_the_rank():
    buckets = ((0.1, 10.0), (0.2, 30.0), (0.5, 40.0), (INF, 40.0))
    assert percentile(buckets, 0.5) == pytest.approx(0.15)  # rank 20: halfway through (0.1, 0.2]
    assert percentile(buckets, 0.375) == pytest.approx(0.1 + 0.1 * 5 / 20)  # rank 15: a quarter through
    assert percentile(buckets, 1.0) == pytest.approx(0.5)
    assert percentile(((0.1, 0.0), (INF, 0.0)), 0.5) is None
    assert percentile(((0.1, 0.0), (1.0, 0.0), (INF, 5.0)), 0.5) == 1.0  # past the last bound: that bound


def test_only_the_observations_between_two_readings_count():
    before = ((0.1, 100.0), (1.0, 100.0), (INF, 100.0))  # a hundred fast ones before
    after = ((0.1, 100.0), (1.0, 104.0), (INF, 104.0))  # then four slow ones
    assert bucket_delta(before, after) == ((0.1, 0.0), (1.0, 4.0), (INF, 4.0))
    assert percentile(bucket_delta(before, after), 0.5) == pytest.approx(0.55)


def registry_with_traffic():
    r = CollectorRegistry()
    requests = Counter("loraplex_requests", "", ["endpoint", "status"], registry=r)
    ttft = Histogram("loraplex_time_to_first_token_seconds", "", ["model"], buckets=(0.1, 1.0), registry=r)
    budget = Counter("loraplex_budget_rejections", "", ["scope"], registry=r)
    rate = Counter("loraplex_rate_limit_rejections", "", ["limit"], registry=r)
    return r, requests, ttft, budget, rate


def samples(registry):
    return [s for family in registry.collect() for s in family.samples]


def test_a_point_is_rates_latencies_and_429s_by_reason_over_its_interval():
    registry, requests, ttft, budget, rate = registry_with_traffic()
    first = read(samples(registry), STATS, at=100.0, wall=1000.0)
    requests.labels("/v1/chat/completions", "200").inc(8)
    requests.labels("/v1/completions", "429").inc(3)
    requests.labels("/v1/chat/completions", "503").inc(2)
    requests.labels("/health", "200").inc(50)  # not a generation
    budget.labels("tenant").inc()
    rate.labels("requests").inc()
    for seconds in (0.05, 0.05, 0.5, 0.5):
        ttft.labels("m").observe(seconds)
    second = read(samples(registry), STATS, at=102.0, wall=1002.0)
    p = point(first, second)
    assert p["requests"] == pytest.approx(13 / 2) and p["errors"] == 1.0 and p["rejections"] == 1.5
    assert p["ttft"][0] == pytest.approx(100.0)  # p50 in ms: the top of the first bucket
    assert p["kv_use"] == 0.25 and p["queue"]["realtime"] == 2 and p["running"] == 1
    assert second.rejections == {"budget (tenant)": 1, "rate limit (requests/min)": 1, OTHER_429: 1}
    assert second.errors == {"503": 2}


def test_the_history_keeps_its_span_and_no_more():
    registry, requests, *_ = registry_with_traffic()
    clock = iter(range(1000))

    def reading():
        requests.labels("/v1/completions", "200").inc()
        t = float(next(clock))
        return read(samples(registry), STATS, at=t, wall=t)

    history = LiveHistory(reading, interval_s=5.0, span_s=50.0)
    for _ in range(40):
        history.sample()
    body = history.as_json()
    assert len(body["t"]) == 10 and body["t"][-1] == 39.0
    chart = next(c for c in body["charts"] if c["id"] == "requests")
    assert chart["series"][0]["values"] == [1.0] * 10
    assert body["window"]["seconds"] == 10
