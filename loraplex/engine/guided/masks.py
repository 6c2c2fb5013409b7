"""A step's masks for its guided rows: started on a small thread pool before the forward pass (filled
by llguidance and turned into additive 0 / -inf logits there), applied after it with one add per row on
the CPU, or one index_add_ over the guided rows on an accelerator (no Python loop over the vocabulary).

Why numpy on the CPU: its add runs on the calling thread; torch splits a 49K-wide add over its thread
pool, whose wake-ups cost more than the add on a busy machine (measured: 0.1-12 ms for 8 rows)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from loraplex.engine.guided.guide import Guide

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def spare_cores() -> int:
    """CPU cores that a forward pass on the CPU leaves idle (torch's intra-op threads take the rest)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(0, cores - torch.get_num_threads())


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="guided-mask")
        return _POOL


def start_masks(guides: Iterable[Guide], on_cpu: bool = False) -> None:
    """Starts each guide's mask for the coming step, to be ready when the logits are. A forward pass on
    the CPU that keeps every core busy is not raced: there the sampler fills the masks itself, on the
    engine thread (measured on 2 cores: racing it cost 3% more than filling after it)."""
    if on_cpu and spare_cores() == 0:
        return
    pool = None
    for g in guides:
        pool = pool or _pool()
        g.start_mask(pool)


def apply_masks(logits: torch.Tensor, rows: list[tuple[int, Guide]]) -> None:
    """logits: [rows, vocab] fp32; sets -inf where each (row, guide)'s mask disallows, in place. A guide
    whose mask failed is skipped (its `error` is set; the core ends that request)."""
    ready = [(i, bias) for i, g in rows if (bias := g.mask()) is not None]
    if not ready:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        rows_np = logits.detach().numpy()
        for i, bias in ready:
            np.add(rows_np[i], bias, out=rows_np[i])
        return
    index = torch.tensor([i for i, _ in ready], device=logits.device)
    biases = torch.from_numpy(np.stack([b for _, b in ready])).to(logits.device, non_blocking=True)  # one copy
    logits.index_add_(0, index, biases.to(logits.dtype))
