"""Adapter popularity patterns and batches shared by the LoRA kernel tests (Triton and C)."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.engine.kernels.lora_ops import LoraBatchIndex


def request_slots(pattern: str, n: int, with_base: bool, rng: np.random.Generator, num_slots: int) -> list[int]:
    """One slot per request under `pattern`; with_base makes every third request a base-model one (-1)."""
    if pattern == "distinct":
        slots = list(rng.permutation(num_slots)[:n])
    elif pattern == "uniform":
        slots = list(rng.integers(0, num_slots, n))
    elif pattern.startswith("zipf:"):
        p = 1.0 / np.arange(1, num_slots + 1) ** float(pattern[5:])
        slots = list(rng.choice(num_slots, n, p=p / p.sum()))
    elif pattern == "identical":
        slots = [5] * n
    elif pattern == "skewed":  # one hot adapter, a few rare ones
        slots = [3 if rng.random() < 0.75 else int(rng.integers(num_slots // 2, num_slots)) for _ in range(n)]
    else:
        raise AssertionError(pattern)
    if with_base:
        slots[::3] = [-1] * len(slots[::3])
    return [int(s) for s in slots]


def make_batch(pattern: str, shape: str, with_base: bool, num_slots: int, seed: int = 0,
               prefill_len: tuple[int, int] = (5, 20), decodes: int = 16,
               device: torch.device | str | None = None) -> LoraBatchIndex:
    """prefill: a few requests with long prompts (segments); decode: one token per request. The index's
    tensors on `device` (default the CPU)."""
    rng = np.random.default_rng(seed)
    lens = [int(v) for v in rng.integers(*prefill_len, 4)] if shape == "prefill" else [1] * decodes
    return LoraBatchIndex.from_segments(lens, request_slots(pattern, len(lens), with_base, rng, num_slots), device)
