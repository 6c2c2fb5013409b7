"""The learned scorer's head: logistic regression over hashed features, fitted with numpy.

- A batch of requests is a sparse matrix in CSR form (`Batch`): rows' hashed buckets and values,
  plus the dense block; one weight vector [features.WEIGHTS] holds both (dense features take the first
  DENSE slots, which hashed features never use).
- Fitting is full-batch Adam on the mean log loss with an L2 penalty, from zeros, a fixed number of
  steps: no randomness, so the same data gives the same weights. The dense block is fitted
  standardized (each feature centred and scaled to unit deviation over the training rows, so one
  penalty means the same for every feature whatever its scale), then folded back into raw weights
  and the bias: scoring reads the raw features.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loraplex.platform.routing.learned.features import DENSE, WEIGHTS, Features


@dataclass(frozen=True)
class Batch:
    """N requests: `rows` [K] int64 row of each entry, `index` [K] int64 bucket, `value` [K] float32;
    `dense` [N, DENSE] float32."""

    rows: np.ndarray
    index: np.ndarray
    value: np.ndarray
    dense: np.ndarray

    @property
    def size(self) -> int:
        return len(self.dense)

    @classmethod
    def of(cls, features: list[Features]) -> Batch:
        rows = np.concatenate([np.full(len(f.index), i, np.int64) for i, f in enumerate(features)]
                              or [np.zeros(0, np.int64)])
        index = np.concatenate([f.index for f in features] or [np.zeros(0, np.int64)])
        value = np.concatenate([f.value for f in features] or [np.zeros(0, np.float32)])
        dense = np.stack([f.dense for f in features]) if features else np.zeros((0, DENSE), np.float32)
        return cls(rows, index, value, dense)

    def take(self, keep: np.ndarray) -> Batch:
        """The rows where `keep` [N] bool is set, renumbered."""
        new_row = np.cumsum(keep) - 1
        entries = keep[self.rows]
        return Batch(new_row[self.rows[entries]], self.index[entries], self.value[entries], self.dense[keep])


def logits(weights: np.ndarray, batch: Batch) -> np.ndarray:
    """[N] float64 logits."""
    sparse = np.bincount(batch.rows, weights=weights[batch.index] * batch.value, minlength=batch.size)
    sparse = sparse.astype(np.float64)  # (an empty batch's bincount is int)
    return sparse + batch.dense.astype(np.float64) @ weights[:DENSE]


def _standardizer(dense: np.ndarray, sw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[DENSE] weighted means and deviations of the dense features (the bias: 0 and 1; a constant
    feature: deviation inf, so its standardized column is 0 and its weight stays 0)."""
    mean = sw @ dense
    dev = np.sqrt(sw @ (dense - mean) ** 2)
    dev[dev < 1e-6] = np.inf
    mean[DENSE - 1], dev[DENSE - 1] = 0.0, 1.0
    return mean, dev


def fit(batch: Batch, target: np.ndarray, l2: float = 1e-4, steps: int = 300, lr: float = 0.05,
        sample_weight: np.ndarray | None = None, l2_dense: float | None = None) -> np.ndarray:
    """[WEIGHTS] float32 weights minimising the weighted mean log loss against `target` [N]
    (probabilities, 0..1; or soft targets a little outside them) plus l2 / 2 * |w_hashed|^2 +
    l2_dense / 2 * |w_dense standardized|^2 (default l2; the bias, last dense slot, unpenalised)."""
    n = batch.size
    sw = np.ones(n) if sample_weight is None else np.asarray(sample_weight, np.float64)
    sw = sw / sw.sum()
    mean, dev = _standardizer(batch.dense.astype(np.float64), sw)
    dense = (batch.dense.astype(np.float64) - mean) / dev  # [N, DENSE]
    standardized = Batch(batch.rows, batch.index, batch.value, dense)
    w = np.zeros(WEIGHTS)
    m, v = np.zeros_like(w), np.zeros_like(w)
    penalty = np.full_like(w, l2)  # [WEIGHTS]
    penalty[:DENSE] = l2 if l2_dense is None else l2_dense
    penalty[DENSE - 1] = 0.0
    b1, b2 = 0.9, 0.999
    for t in range(1, steps + 1):
        p = 1.0 / (1.0 + np.exp(-logits(w, standardized)))
        err = (p - target) * sw  # [N]
        grad = np.bincount(batch.index, weights=batch.value * err[batch.rows], minlength=len(w)).astype(np.float64)
        grad[:DENSE] += dense.T @ err
        grad += penalty * w
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad * grad
        w -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + 1e-8)
    w[:DENSE] /= dev  # back to raw features: w . (x - mean) / dev = (w / dev) . x - (w / dev) . mean
    w[DENSE - 1] -= w[:DENSE - 1] @ mean[:DENSE - 1]
    return w.astype(np.float32)
