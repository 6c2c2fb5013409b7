"""Paged KV cache: the block bookkeeping and the per-layer cache tensors.

A request owns a list of block ids (its block table); token at position p lives in block
table[p // block_size], offset p % block_size. Blocks carry a reference count so that the prefix
cache can later share full blocks between requests.
"""

from __future__ import annotations

from collections import deque

import torch


class BlockPool:
    """Free list and reference counts of `num_blocks` KV blocks. Admission asks `can_allocate`
    first and then `allocate`, so a request never holds half of what it needs."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Drops one reference from each block; blocks nobody holds go back to the free list.
        Freed in reverse so a request's tail blocks are reused first."""
        for b in reversed(ids):
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


def allocate_kv_tensors(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v), each [num_blocks, block_size, n_kv_heads, head_dim], zero-filled."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    storage = torch.zeros(shape, dtype=dtype, device=device)
    return [(storage[i, 0], storage[i, 1]) for i in range(num_layers)]
