"""Paged KV cache: block bookkeeping (free list, reference counts, cached full blocks) and the
cache tensors.

A request owns a list of block ids (its block table); token at position p lives in block
table[p // block_size], offset p % block_size. Full blocks may carry a content hash (see
prefix_cache.py): freed, they stay in the free list with their hash and can be revived by a later
request with the same prefix, until allocation reuses them (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from loraplex.engine.kv.kv_dtype import row_width


class BlockPool:
    """Admission asks `can_allocate` first and then `allocate`, so a request never holds half of
    what it needs. Blocks in use (reference count > 0) are never evicted from the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Front = allocated next: uncached blocks first, then cached ones, least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks nobody holds (cached ones included: they are reusable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of[b]
            if h is not None:  # reusing a cached block evicts its content from the prefix cache
                del self._cached[h]
                self._hash_of[b] = None
                self.evictions += 1
            self._refs[b] = 1
            ids.append(b)
        return ids

    def free(self, ids: list[int]) -> None:
        """Drops one reference from each block. Unreferenced blocks go back to the free list: uncached
        ones to the front (reused first), cached ones to the back (kept longest). Freed in reverse so
        a request's tail blocks, the least shareable, are evicted first."""
        for b in reversed(ids):
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
                if self._hash_of[b] is None:
                    self._free.move_to_end(b, last=False)

    # --- prefix cache ---------------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (a chain: each hash covers its parents)."""
        hits = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def take(self, ids: list[int]) -> None:
        """Adds a reference to cached blocks a request reuses, reviving free ones."""
        for b in ids:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Marks a full block as holding the content `block_hash` names (first holder wins)."""
        if block_hash not in self._cached and self._hash_of[block] is None:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash


def allocate_kv_storage(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """One zero-filled tensor [layers, 2 (k, v), num_blocks, block_size, n_kv_heads, row width] of the KV cache's
    dtype (row width: head_dim, plus an 8-bit row's scale, kv_dtype.py): a block's K and V in every layer (and
    their scales) can be copied (swapped) with one indexing op."""
    return torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype)),
                       dtype=dtype, device=device)


def layer_views(storage: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v), each [num_blocks, block_size, n_kv_heads, row width]."""
    return [(storage[i, 0], storage[i, 1]) for i in range(storage.shape[0])]


def allocate_kv_tensors(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return layer_views(allocate_kv_storage(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device))
