"""Roofline figures of this machine, measured in the same run as the benchmark they bound."""

from __future__ import annotations

import time

import torch


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def mem_read_gbs(num_bytes: int = 512 * 1024 * 1024, repeats: int = 5) -> float:
    """Streaming read bandwidth: a sum over a buffer far larger than the caches."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _best_seconds(lambda: x.sum(), repeats) / 1e9


def gemm_gflops(n: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """Dense GEMM rate on a large square matmul."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, repeats) / 1e9


def measure() -> dict[str, float]:
    return {"mem_read_gbs": round(mem_read_gbs(), 2), "gemm_gflops": round(gemm_gflops(), 1)}
