"""Pieces the Triton GEMM kernels (sgmv, bgmv, w8a16) share: an adapter's rank, a split-K program's range of
k, and its store."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def adapter_rank(ranks_ptr, slot, r_max, HAS_RANKS: tl.constexpr):
    """The rank of the adapter in `slot` (ranks_ptr [slots]), at most r_max; r_max when ranks are not given."""
    rank = r_max
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), r_max)
    return rank


@triton.jit
def k_range(pid_k, k_total, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_start, k_end) of split pid_k of SPLIT_K over k_total, each split a whole number of BLOCK_K."""
    k_len = tl.cdiv(k_total, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_len
    return k_start, tl.minimum(k_start + k_len, k_total)


@triton.jit
def store_split(ptrs, values, mask, SPLIT_K: tl.constexpr):
    """One split stores its tile (cast to the output's dtype); several add theirs into a zero-filled fp32 output."""
    if SPLIT_K == 1:
        tl.store(ptrs, values.to(ptrs.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, values, mask=mask)
