"""The scorers `model: "auto"` can route by, behind one small interface.

- `Scorer.score(request)` -> 0..1, the probability that the request needs the pool's most capable
  model (learned) or the heuristic's weighted signals; `explain` names what drove it.
- `LearnedScorer`: logistic regression over features.py's features, weights from a .npz file
  (the package's `default.npz`, trained by `loraplex router train` on public data; or an operator's).
- `HeuristicScorer`: complexity.py's hand-set signals, the explainable fallback.
Both are deterministic (same request, same score, in any process) and bounded by their scan limits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

import numpy as np

from loraplex.platform.routing import complexity
from loraplex.platform.routing.complexity import RequestText
from loraplex.platform.routing.learned import features
from loraplex.platform.routing.learned.features import DENSE, DENSE_NAMES, WEIGHTS

FORMAT = "loraplex-router/1"
MAX_WEIGHTS_BYTES = 16 << 20


@dataclass(frozen=True)
class Driver:
    """One thing that moved the score: its name and its contribution (learned: to the logit)."""

    name: str
    contribution: float


@dataclass(frozen=True)
class Explanation:
    score: float
    drivers: list[Driver]  # largest |contribution| first


class Scorer(Protocol):
    name: str

    def score(self, req: RequestText) -> float: ...

    def explain(self, req: RequestText, top: int = 8) -> Explanation: ...


class HeuristicScorer:
    """complexity.py's weighted signals (the score an operator can predict by hand)."""

    name = "heuristic"

    def score(self, req: RequestText) -> float:
        return complexity.score(req).score

    def explain(self, req: RequestText, top: int = 8) -> Explanation:
        scored = complexity.score(req)
        drivers = [Driver(n, round(v * complexity.WEIGHTS[n], 4)) for n, v in scored.signals.items()]
        drivers.sort(key=lambda d: -abs(d.contribution))
        return Explanation(scored.score, drivers[:top])


class WeightsError(ValueError):
    """A weights file that is not one this code can score with (the message says why)."""


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


class LearnedScorer:
    """P(strong model needed) from features.py's features and a weight vector [features.WEIGHTS]."""

    name = "learned"

    def __init__(self, weights: np.ndarray, meta: dict):
        if weights.shape != (WEIGHTS,) or not np.all(np.isfinite(weights)):
            raise WeightsError(f"router weights must be {WEIGHTS} finite numbers, got shape {weights.shape}")
        self.weights = weights.astype(np.float64)
        self.meta = meta

    @classmethod
    def load(cls, path: str | Path | None = None) -> LearnedScorer:
        """From a file `save` wrote; None: the weights shipped in the package."""
        if path is None:
            with resources.as_file(resources.files(__package__) / "default.npz") as shipped:
                return cls.load(shipped)
        path = Path(path)
        try:
            if path.stat().st_size > MAX_WEIGHTS_BYTES:
                raise WeightsError(f"{path}: over {MAX_WEIGHTS_BYTES} bytes, not a router weights file")
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                weights = data["weights"]
        except (OSError, KeyError, ValueError) as exc:
            if isinstance(exc, WeightsError):
                raise
            raise WeightsError(f"{path}: not a router weights file ({exc})") from None
        if meta.get("format") != FORMAT or meta.get("features") != features.VERSION:
            raise WeightsError(f"{path}: weights for {meta.get('format')}/{meta.get('features')}, this scorer reads "
                               f"{FORMAT}/{features.VERSION}; train them again with `loraplex router train`")
        return cls(weights, meta)

    def save(self, path: str | Path) -> None:
        meta = {**self.meta, "format": FORMAT, "features": features.VERSION}
        with open(path, "wb") as out:  # np.savez would add ".npz" to a name without it
            # a hashed vector in half precision (its size); the dense weights alone in single (the bias is their sum)
            dtype = np.float16 if len(self.weights) > 4096 else np.float32
            np.savez_compressed(out, weights=self.weights.astype(dtype), meta=np.array(json.dumps(meta)))

    def logit(self, f: features.Features) -> float:
        # elementwise products and sums, not `@`: a BLAS dot here may wake BLAS threads, costing ms under load
        return float((self.weights[f.index] * f.value).sum() + (self.weights[:DENSE] * f.dense).sum())

    def score(self, req: RequestText) -> float:
        return round(_sigmoid(self.logit(features.featurize(req))), 4)

    def explain(self, req: RequestText, top: int = 8) -> Explanation:
        """The dense features' and the hashed n-grams' contributions to the logit, summed by text."""
        f = features.featurize(req)
        sums = {name: float(self.weights[i] * value) for i, (name, value) in enumerate(zip(DENSE_NAMES, f.dense,
                                                                                           strict=True))}
        offset = 0
        for kind, spans in f.spans.items():
            for (start, end), idx, val in zip(spans, f.index[offset:offset + len(spans)],
                                              f.value[offset:offset + len(spans)], strict=True):
                key = f"{features.KIND_NAMES[kind]} {f.text[start:end].lower()!r}"
                sums[key] = sums.get(key, 0.0) + float(self.weights[idx] * val)
            offset += len(spans)
        drivers = sorted((Driver(k, round(v, 4)) for k, v in sums.items()), key=lambda d: -abs(d.contribution))
        return Explanation(round(_sigmoid(self.logit(f)), 4), drivers[:top])


def load_scorer(kind: str = "learned", weights: str | Path | None = None) -> Scorer:
    """The scorer settings name: "learned" (from `weights`, default the shipped file) or "heuristic"."""
    if kind == "heuristic":
        return HeuristicScorer()
    if kind == "learned":
        return LearnedScorer.load(weights)
    raise ValueError(f"router must be 'learned' or 'heuristic', got {kind!r}")
