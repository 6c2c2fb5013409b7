"""The one percentile every benchmark reports, so that a p99 means the same in each (stdlib only: the GPU
check imports it on an engine-only box)."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, interpolated linearly between the closest ranks (numpy's
    default); ValueError when `values` is empty."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
