"""`loraplex bench router`: the learned scorer's held-out APGR against length-only and random routing
(loraplex/platform/routing/learned/evaluation.py), and its scoring time per request."""

from __future__ import annotations

import time

import numpy as np

from loraplex.platform.routing.learned import evaluation, training
from loraplex.platform.routing.learned.scorer import LearnedScorer


def _latency(examples: list[training.Example], weights: str | None, rounds: int = 3) -> dict:
    """The shipped (or given) scorer's time per request over the file's requests, in ms."""
    scorer = LearnedScorer.load(weights)
    times = []
    for _ in range(rounds):
        for e in examples:
            start = time.perf_counter()
            scorer.score(e.request)
            times.append(time.perf_counter() - start)
    ms = np.array(times) * 1000
    return {"requests": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 4),
            "p99_ms": round(float(np.percentile(ms, 99)), 4), "max_ms": round(float(ms.max()), 4)}


def run_router_bench(data: str, folds: int, bootstrap: int, weights: str | None) -> dict:
    with open(data, "rb") as stream:
        examples = training.read_examples(stream)
    results = evaluation.report(examples, k=folds, rounds=bootstrap)
    results["data"] = data
    results["scorer_latency"] = _latency(examples, weights)
    return results
