"""What every attention backend provides, and the step layout they all start from.

A backend turns one step's sequences into its own metadata once (every layer reuses it), then runs
each layer's attention for the whole mixed batch over the paged cache: prefill chunks (the first
chunk of a prompt, a chunk after a prefix-cache hit or an earlier chunk) and decode rows (a decode's
one new token, and each speculative draft after it, every row with its own context length).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from loraplex.engine.kv import kv_dtype

# A sequence with a context and at most this many new tokens is attended as decode rows, one per
# token: cheaper than a prefill tile for the few tokens of a decode with drafts or a short tail.
MAX_DECODE_QUERIES = 8

# One sequence of a step, in batch order: (tokens already in its cache, new tokens, its block ids)
StepSeq = tuple[int, int, list[int]]


def is_decode(computed: int, new: int) -> bool:
    """Whether a sequence's new tokens are attended as decode rows (else as one prefill chunk)."""
    return computed > 0 and new <= MAX_DECODE_QUERIES


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores this step's K/V at their flat slots (block * block_size + offset) before any row attends, in the
    caches' dtype (8-bit: quantized with their scales, kv/kv_dtype.py).

    k, v: [tokens, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, row width]."""
    kv_dtype.write_rows(k, k_cache, slot_mapping)
    kv_dtype.write_rows(v, v_cache, slot_mapping)


def slots_of(computed: int, new: int, blocks: list[int], block_size: int) -> list[int]:
    """Flat cache slots of positions computed .. computed + new - 1 of a sequence owning `blocks`."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(computed, computed + new)]


class AttentionBackend(ABC):
    """One family of attention kernels; stateless, shared by every model that uses it."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    # the fused CPU decode step (kernels/cpu/decode_step.c) does this backend's attention itself
    fused_decode_step: bool = False

    def unsupported_kv(self, kv: torch.dtype, head_dim: int) -> str | None:
        """Why this backend cannot read a KV cache of dtype `kv` with `head_dim`; None if it can (every backend
        reads every kv_dtype.KV_CODES type, dequantizing 8-bit rows as it loads them)."""
        return kv_dtype.unsupported(kv, head_dim)

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this backend cannot serve a model on `device` in `dtype` with `head_dim`; None if it can."""
        if dtype not in self.dtypes:
            return f"dtype {dtype} (it takes {', '.join(str(d) for d in self.dtypes)})"
        return None

    @abstractmethod
    def build_metadata(self, seqs: list[StepSeq], block_size: int, device: torch.device,
                       dtype: torch.dtype) -> Any:
        """This step's description for every layer; built once per step, on the host, copied once."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """Writes this step's K/V into the cache and attends every query row to its context.

        q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim];
        caches: [num_blocks, block_size, kv_heads, row width] of the KV cache's dtype (kv/kv_dtype.py).
        Returns [tokens, heads * head_dim]."""
