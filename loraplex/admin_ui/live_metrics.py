"""One reading of the figures the live charts draw, from the engine's stats and the platform's
Prometheus registry, and what two readings say about the seconds between them.

- Counters are totals since start; a point is the difference of two readings over their interval.
- Latency percentiles come from histogram bucket deltas: the requests of that interval only,
  interpolated linearly inside the bucket that holds the rank (Prometheus' histogram_quantile).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from loraplex.engine.api import PRIORITY_CLASSES, EngineStats

GENERATION_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
QUANTILES = (0.5, 0.95, 0.99)
# why a request was answered 429: (registry sample, its label value) -> the reason shown
REJECTION_REASONS = {("loraplex_budget_rejections_total", "tenant"): "budget (tenant)",
                     ("loraplex_budget_rejections_total", "key"): "budget (key)",
                     ("loraplex_rate_limit_rejections_total", "requests"): "rate limit (requests/min)",
                     ("loraplex_rate_limit_rejections_total", "tokens"): "rate limit (tokens/min)"}
OTHER_429 = "other 429"
_HISTOGRAMS = {"loraplex_time_to_first_token_seconds_bucket": "ttft",
               "loraplex_inter_token_latency_seconds_bucket": "itl",
               "loraplex_request_latency_seconds_bucket": "latency"}

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, +Inf last


@dataclass(frozen=True)
class Reading:
    """Totals since start (counters) and what holds now (gauges), at monotonic time `at`."""

    at: float
    wall: float
    requests: float = 0.0  # generation requests answered, whatever their status
    errors: dict[str, float] = field(default_factory=dict)  # 5xx status -> total, every endpoint
    rejections: dict[str, float] = field(default_factory=dict)  # reason -> 429s
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    histograms: dict[str, Buckets] = field(default_factory=dict)  # ttft, itl, latency (seconds)
    queue: dict[str, int] = field(default_factory=dict)  # waiting requests per priority class
    running: int = 0
    kv_use: float = 0.0  # fraction of KV blocks in use


def read(samples: Iterable, stats: EngineStats, at: float, wall: float) -> Reading:
    """A reading from a registry's samples (prometheus_client Sample tuples) and the engine's stats."""
    requests, errors, rejections, tokens = 0.0, {}, {}, {"prompt": 0.0, "completion": 0.0}
    buckets: dict[str, dict[float, float]] = {name: {} for name in _HISTOGRAMS.values()}
    all_429 = 0.0
    for s in samples:
        name, labels, value = s.name, s.labels, s.value
        if name == "loraplex_requests_total":
            status = labels.get("status", "")
            requests += value if labels.get("endpoint") in GENERATION_ENDPOINTS else 0.0
            if status.startswith("5"):
                errors[status] = errors.get(status, 0.0) + value
            all_429 += value if status == "429" else 0.0
        elif name in _HISTOGRAMS:
            into = buckets[_HISTOGRAMS[name]]
            bound = float(labels["le"])
            into[bound] = into.get(bound, 0.0) + value  # summed over models / endpoints
        elif name == "loraplex_tokens_total" and labels.get("kind") in tokens:
            tokens[labels["kind"]] += value
        else:
            reason = REJECTION_REASONS.get((name, labels.get("scope") or labels.get("limit")))
            if reason:
                rejections[reason] = rejections.get(reason, 0.0) + value
    other = all_429 - sum(rejections.values())
    if other > 0:
        rejections[OTHER_429] = other
    kv = stats.kv.blocks_used / stats.kv.blocks_total if stats.kv.blocks_total else 0.0
    return Reading(at, wall, requests, errors, rejections, tokens["prompt"], tokens["completion"],
                   {k: tuple(sorted(v.items())) for k, v in buckets.items()},
                   {c: stats.requests.waiting_by_class.get(c, 0) for c in PRIORITY_CLASSES}, stats.requests.running, kv)


def bucket_delta(before: Buckets, after: Buckets) -> Buckets:
    """The observations made between two readings of one histogram, per bucket."""
    earlier = dict(before)
    return tuple((bound, max(count - earlier.get(bound, 0.0), 0.0)) for bound, count in after)


def percentile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile of cumulative buckets (None: no observations); past the last finite bound it
    answers that bound, as nothing more is known."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, low, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return low
            inside = count - below
            return low + (bound - low) * ((rank - below) / inside if inside else 1.0)
        low, below = bound, count
    return low


def _rate(after: float, before: float, seconds: float) -> float:
    return max(after - before, 0.0) / seconds


def _quantiles_ms(before: Reading, after: Reading, histogram: str) -> list[float | None]:
    delta = bucket_delta(before.histograms.get(histogram, ()), after.histograms.get(histogram, ()))
    return [None if (v := percentile(delta, q)) is None else round(v * 1000, 2) for q in QUANTILES]


def point(before: Reading, after: Reading) -> dict:
    """What the charts draw for the interval between two readings (rates per second, latencies in ms)."""
    seconds = max(after.at - before.at, 1e-6)
    return {"t": round(after.wall, 3),
            "requests": round(_rate(after.requests, before.requests, seconds), 3),
            "prompt_tokens": round(_rate(after.prompt_tokens, before.prompt_tokens, seconds), 2),
            "output_tokens": round(_rate(after.output_tokens, before.output_tokens, seconds), 2),
            "ttft": _quantiles_ms(before, after, "ttft"), "itl": _quantiles_ms(before, after, "itl"),
            "latency": _quantiles_ms(before, after, "latency"),
            "queue": dict(after.queue), "running": after.running, "kv_use": round(after.kv_use, 4),
            "rejections": round(_rate(sum(after.rejections.values()), sum(before.rejections.values()), seconds), 3),
            "errors": round(_rate(sum(after.errors.values()), sum(before.errors.values()), seconds), 3)}


def window(first: Reading, last: Reading) -> dict:
    """Counts and latency percentiles between two readings (the charts' span), for the panel's tables."""
    def counts(now: dict[str, float], then: dict[str, float]) -> dict[str, int]:
        return {k: int(v - then.get(k, 0.0)) for k, v in sorted(now.items())}

    return {"seconds": round(last.at - first.at), "rejections": counts(last.rejections, first.rejections),
            "errors": counts(last.errors, first.errors),
            "latency": dict(zip(("p50", "p95", "p99"), _quantiles_ms(first, last, "latency"), strict=True)),
            "ttft": dict(zip(("p50", "p95", "p99"), _quantiles_ms(first, last, "ttft"), strict=True)),
            "rejections_since_start": {k: int(v) for k, v in sorted(last.rejections.items())},
            "errors_since_start": {k: int(v) for k, v in sorted(last.errors.items())}}
