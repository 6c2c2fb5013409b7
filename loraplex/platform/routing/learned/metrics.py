"""How well a router's scores route, by RouteLLM's measures.

- APGR: send the k highest-scored prompts to the strong model, k = 0..N; at each k the performance
  gap recovered is (accuracy_k - accuracy_weak) / (accuracy_strong - accuracy_weak); APGR is its mean
  over k. Prompts with equal scores are taken in a random order, so the curve within a tie group is
  its expectation (linear): a constant score gets exactly the random router's 0.5-ish.
- share_to_recover(x): the smallest share k / N of strong calls whose gap recovered reaches x.
"""

from __future__ import annotations

import numpy as np


def gap_curve(scores: np.ndarray, weak: np.ndarray, strong: np.ndarray) -> np.ndarray:
    """[N + 1] the gap recovered after routing the k best-scored prompts, k = 0..N (NaN if no gap)."""
    scores, weak, strong = (np.asarray(a, np.float64) for a in (scores, weak, strong))
    gain = strong - weak  # [N] what routing each prompt to the strong model adds
    gap = gain.sum()
    if len(scores) == 0 or gap == 0:
        return np.full(len(scores) + 1, np.nan)
    order = np.argsort(-scores, kind="stable")
    s, g = scores[order], gain[order]
    # tie groups in sorted order: within one, each prompt adds the group's mean gain
    new_group = np.concatenate(([True], s[1:] != s[:-1]))
    group = np.cumsum(new_group) - 1
    group_gain = np.bincount(group, weights=g) / np.bincount(group)
    curve = np.concatenate(([0.0], np.cumsum(group_gain[group])))
    return curve / gap


def apgr(scores: np.ndarray, weak: np.ndarray, strong: np.ndarray) -> float:
    return float(np.mean(gap_curve(scores, weak, strong)))


def share_to_recover(scores: np.ndarray, weak: np.ndarray, strong: np.ndarray, recovered: float) -> float:
    """The least share of strong calls (0..1) whose gap recovered reaches `recovered`."""
    curve = gap_curve(scores, weak, strong)
    reached = np.flatnonzero(curve >= recovered - 1e-12)
    return float(reached[0] / (len(curve) - 1)) if len(reached) else float("nan")


def summary(scores: np.ndarray, weak: np.ndarray, strong: np.ndarray) -> dict[str, float]:
    return {"apgr": apgr(scores, weak, strong),
            "strong_share_for_50pct": share_to_recover(scores, weak, strong, 0.5),
            "strong_share_for_80pct": share_to_recover(scores, weak, strong, 0.8)}


def bootstrap(scores: np.ndarray, weak: np.ndarray, strong: np.ndarray, rounds: int = 200,
              seed: int = 0) -> dict[str, tuple[float, float]]:
    """95% percentile intervals of summary()'s figures over prompts resampled with replacement."""
    rng = np.random.default_rng(seed)
    scores, weak, strong = (np.asarray(a) for a in (scores, weak, strong))
    draws: dict[str, list[float]] = {}
    for _ in range(rounds):
        pick = rng.integers(0, len(scores), len(scores))
        for name, value in summary(scores[pick], weak[pick], strong[pick]).items():
            draws.setdefault(name, []).append(value)
    return {name: (float(np.nanpercentile(v, 2.5)), float(np.nanpercentile(v, 97.5))) for name, v in draws.items()}
