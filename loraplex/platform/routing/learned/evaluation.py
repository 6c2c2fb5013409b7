"""Held-out evaluation of the learned scorer against length-only and random routing (`bench router`).

- Folds: within a `set` that has several domains (MMLU's subjects), whole domains go to one fold,
  so every score is for a subject the model never saw; a set with one domain (GSM8K) is split by
  problem. Each fold's examples are scored by a model fitted on all the other folds: nothing is
  scored by a model that trained on it.
- Per set (and over all): APGR, the strong-call share that recovers 50% and 80% of the gap, each
  with a bootstrap interval, for the learned scores, prompt length, and a seeded random order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from loraplex.platform.routing.learned import linear, metrics, training
from loraplex.platform.routing.learned.training import Example


def folds(examples: Sequence[Example], k: int) -> np.ndarray:
    """[N] the fold (0..k-1) of each example: by domain where its set has several, else by prompt."""
    domains: dict[str, set[str]] = {}
    for e in examples:
        domains.setdefault(e.set, set()).add(e.domain)
    out = np.empty(len(examples), np.int64)
    ranks = {(s, d): i for s, ds in domains.items() for i, d in enumerate(sorted(ds))}
    for i, e in enumerate(examples):
        if len(domains[e.set]) > 1:
            out[i] = ranks[(e.set, e.domain)] % k
        else:
            digest = hashlib.sha256(e.request.last_user.encode("utf-8", "surrogatepass")).digest()
            out[i] = int.from_bytes(digest[:8], "little") % k
    return out


def held_out_scores(examples: Sequence[Example], k: int = 5) -> np.ndarray:
    """[N] each example's logit from a model fitted without its fold."""
    batch = training.batch_of(examples)
    fold = folds(examples, k)
    out = np.zeros(len(examples))
    for f in range(k):
        test = fold == f
        if not test.any() or test.all():
            continue
        train = ~test
        weights = training.fit(batch.take(train), [e for e, t in zip(examples, train, strict=True) if t])
        out[test] = linear.logits(weights.astype(np.float64), batch.take(test))
    return out


def _figures(scores: np.ndarray, weak: np.ndarray, strong: np.ndarray, rounds: int) -> dict:
    point = metrics.summary(scores, weak, strong)
    interval = metrics.bootstrap(scores, weak, strong, rounds)
    return {name: {"value": round(v, 4), "ci95": [round(x, 4) for x in interval[name]]} for name, v in point.items()}


def report(examples: Sequence[Example], k: int = 5, rounds: int = 200, seed: int = 0) -> dict:
    """The bench's figures (module docstring) as a JSON-able dict."""
    learned = held_out_scores(examples, k)
    length = np.array([float(e.request.prompt_chars) for e in examples])
    shuffled = np.random.default_rng(seed).permutation(len(examples)).astype(np.float64)
    weak = np.array([e.weak_correct for e in examples], np.float64)
    strong = np.array([e.strong_correct for e in examples], np.float64)
    sets = np.array([e.set for e in examples])
    out: dict = {"examples": len(examples), "folds": k, "bootstrap_rounds": rounds, "sets": {}}
    for name in [*sorted(set(sets)), "all"] if len(set(sets)) > 1 else ["all"]:
        pick = np.ones(len(examples), bool) if name == "all" else sets == name
        out["sets"][name] = {
            "examples": int(pick.sum()),
            "weak_accuracy": round(float(weak[pick].mean()), 4),
            "strong_accuracy": round(float(strong[pick].mean()), 4),
            "routers": {router: _figures(s[pick], weak[pick], strong[pick], rounds)
                        for router, s in (("learned", learned), ("length", length), ("random", shuffled))}}
    return out
