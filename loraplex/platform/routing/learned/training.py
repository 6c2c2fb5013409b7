"""Labelled routing data and fitting the learned scorer on it (`loraplex router train`).

- A labelled line is a request (requests.py: `prompt` or `messages`) with `weak_correct` and
  `strong_correct` (booleans: did the small and the large model answer it well), and optionally
  `set` and `domain` (what the evaluation holds out together).
- The target is soft: 1 when only the strong model was right, 0 when only the weak one was, 0.5
  when both or neither were. Ranking by it is ranking by the expected gain of a strong call, which
  is what APGR scores; on the shared RouteLLM file it beat the hard "strong needed" label on held-out
  APGR (docs/routing.md has the figures).
- The target is centred within each kind of request (multiple-choice, open): each kind's mean
  target over the training rows becomes 0.5. The scorer ranks requests within a kind by what their
  text says, not by how often that kind needed the strong model in the training data: a training
  mean carries no word about an unseen subject's prompts, and in held-out folds it is even
  anti-informative (the folds' means pull opposite ways).
- Every example weighs the same (SET_BALANCE 0): weighing each `set` the same (1), so that GSM8K
  counts as much as MMLU, ranked worse on both in held-out APGR (docs/routing.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np

from loraplex.platform.routing.complexity import RequestText
from loraplex.platform.routing.learned import features, linear
from loraplex.platform.routing.learned.requests import BadLine, json_lines, parse_request
from loraplex.platform.routing.learned.scorer import LearnedScorer

L2 = 1e-4  # on the hashed features
L2_DENSE = 1e-2  # on the dense ones, standardized (linear.py)
STEPS = 200
LR = 0.1
SET_BALANCE = 0.0


@dataclass(frozen=True)
class Example:
    request: RequestText
    weak_correct: bool
    strong_correct: bool
    set: str = ""
    domain: str = ""

    @property
    def target(self) -> float:
        return (float(self.strong_correct) - float(self.weak_correct) + 1.0) / 2.0


def read_examples(stream: IO[bytes]) -> list[Example]:
    """The labelled lines of a JSON-lines stream; BadLine names the first bad one."""
    out = []
    for number, obj in json_lines(stream):
        try:
            request = parse_request(obj)
            labels = [obj.get(k) for k in ("weak_correct", "strong_correct")]
            if not all(isinstance(v, bool) for v in labels):
                raise ValueError("weak_correct and strong_correct must be true or false")
            tags = [obj.get(k, "") for k in ("set", "domain")]
            if not all(isinstance(v, str) and len(v) <= 200 for v in tags):
                raise ValueError("set and domain must be strings of at most 200 characters")
        except ValueError as exc:
            raise BadLine(f"line {number}: {exc}") from None
        out.append(Example(request, *labels, *tags))
    if not out:
        raise BadLine("no labelled lines")
    return out


def batch_of(examples: Sequence[Example]) -> linear.Batch:
    return linear.Batch.of([features.featurize(e.request) for e in examples])


def set_weights(examples: Sequence[Example]) -> np.ndarray:
    """[N] each example's weight: (its set's size) ** -SET_BALANCE (1: every set counts the same;
    0: every example does)."""
    sets = [e.set for e in examples]
    sizes = {s: sets.count(s) for s in set(sets)}
    return np.array([float(sizes[s]) ** -SET_BALANCE for s in sets])


def centred_targets(batch: linear.Batch, examples: Sequence[Example], weight: np.ndarray) -> np.ndarray:
    """[N] soft targets shifted so that each kind of request (multiple-choice or open) has a weighted
    mean of 0.5 (module docstring)."""
    target = np.array([e.target for e in examples])
    kind = batch.dense[:, features.DENSE_NAMES.index("choices")] > 0.5
    for pick in (kind, ~kind):
        if pick.any():
            target[pick] += 0.5 - np.average(target[pick], weights=weight[pick])
    return target


def fit(batch: linear.Batch, examples: Sequence[Example]) -> np.ndarray:
    """[features.WEIGHTS] weights for these examples (batch: their features, in order)."""
    weight = set_weights(examples)
    return linear.fit(batch, centred_targets(batch, examples, weight), l2=L2, steps=STEPS, lr=LR,
                      sample_weight=weight, l2_dense=L2_DENSE)


def train(examples: Sequence[Example], source: str = "") -> LearnedScorer:
    """A scorer fitted on all of `examples`; `source` is recorded in its metadata."""
    weights = fit(batch_of(examples), examples)
    sets = sorted({e.set for e in examples})
    meta = {"trained_on": source, "examples": len(examples), "sets": sets, "target": "soft, centred per kind",
            "l2": L2, "l2_dense": L2_DENSE, "steps": STEPS}
    return LearnedScorer(weights, meta)
