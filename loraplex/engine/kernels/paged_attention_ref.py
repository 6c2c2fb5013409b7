"""Plain-torch reference for the paged attention kernels (paged_attention.py): slow, obvious, fp32.

Every query row is attended on its own, causally, over keys gathered slot by slot from the paged cache,
so the kernels' block-table walk, GQA head mapping, online softmax and tiling all have an independent
check.
"""

from __future__ import annotations

import torch


def context_slots(blocks: list[int], length: int, block_size: int) -> list[int]:
    """Flat cache slots of positions 0..length-1 of a sequence that owns `blocks` (in order)."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(length)]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        seqs: list[tuple[int, int, int, list[int]]], scale: float) -> torch.Tensor:
    """Causal attention of every listed query row over its context in the paged cache.

    q [tokens, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
    seqs: (row_start, n_new, computed, blocks) per sequence: its query rows row_start .. row_start+n_new-1
    are at positions computed .. computed+n_new-1, and query j attends keys 0..computed+j read through
    `blocks`. Query head h uses kv head h // (heads // kv_heads). Computed in fp32; returns
    [tokens, heads, head_dim] in q's dtype, zero on rows no sequence lists.
    """
    tokens, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    k_flat = k_cache.reshape(-1, kv_heads, head_dim)  # [slots, kv_heads, head_dim]
    v_flat = v_cache.reshape(-1, kv_heads, head_dim)
    out = torch.zeros(tokens, heads, head_dim, dtype=torch.float32, device=q.device)
    for row_start, n_new, computed, blocks in seqs:
        slots = torch.tensor(context_slots(blocks, computed + n_new, block_size), device=q.device)
        k = k_flat[slots].float().repeat_interleave(group, dim=1)  # [context, heads, head_dim]
        v = v_flat[slots].float().repeat_interleave(group, dim=1)
        for j in range(n_new):
            n_keys = computed + j + 1
            qj = q[row_start + j].float()  # [heads, head_dim]
            scores = torch.einsum("hd,khd->hk", qj, k[:n_keys]) * scale  # [heads, n_keys]
            out[row_start + j] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[:n_keys])
    return out.to(q.dtype)
