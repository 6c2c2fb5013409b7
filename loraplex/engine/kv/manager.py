"""KVManager: a request's KV blocks, behind request-level calls, so the scheduler keeps policy only.

It owns the device block pool and the CPU swap pool, the prefix cache's content hashes and its
counters. It is the only writer of a request's `blocks`, `block_hashes`, `num_registered`,
`swap_blocks` and `num_cached`, and of `num_computed` where a prefix hit supplies tokens:
- `start` reuses a fresh request's longest cached prefix and allocates its first chunk;
- `grow` allocates for more tokens, all or nothing;
- `cache_full_blocks` offers blocks that became full this step to the prefix cache;
- `preempt` / `swap_in` / `free_swap` move a preempted request's blocks to the swap space and back;
- `free` returns everything a finished request holds;
- `prompt_blocks_to_compute` / `next_uncached_block` tell the scheduler which prompt blocks running
  requests are computing, so another request bringing the same prefix can wait for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loraplex.engine.api import KVCacheStats
from loraplex.engine.kv.block_pool import BlockPool
from loraplex.engine.kv.prefix_cache import chain_hashes, root_hash
from loraplex.engine.sched.request import Request


@dataclass
class KVStats:
    """Counters since start, as the engine stats report them."""

    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_hit_tokens: int = 0  # of which served from it
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


def _no_adapters(adapter_id: str) -> int:
    raise LookupError(f"adapter {adapter_id!r} has no registration: no adapter is registered")


class KVManager:
    """Block allocation and prefix caching per request over a BlockPool (and an optional swap pool).

    `registration(adapter_id)`: which registration of the adapter is live, part of the prefix hashes'
    root (a request's adapter stays registered while it is in the engine)."""

    def __init__(self, pool: BlockPool, *, model: str = "", swap_pool: BlockPool | None = None,
                 prefix_caching: bool = True, registration: Callable[[str], int] = _no_adapters):
        self.pool = pool
        self.swap_pool = swap_pool  # None: preemption recomputes
        self.model = model
        self.prefix_caching = prefix_caching
        self.registration = registration
        self.block_size = pool.block_size
        self.stats = KVStats()

    def cache_stats(self) -> KVCacheStats:
        """The engine stats' KV record: the pools now, the counters since start."""
        pool, swap, counted = self.pool, self.swap_pool, self.stats
        return KVCacheStats(
            blocks_total=pool.num_blocks, blocks_used=pool.num_used, blocks_free=pool.num_free,
            swap_blocks_used=swap.num_used if swap else 0, swapped_out_blocks=counted.swapped_out_blocks,
            swapped_in_blocks=counted.swapped_in_blocks, prefix_cached_blocks=pool.num_cached,
            prefix_query_tokens=counted.prefix_query_tokens, prefix_hit_tokens=counted.prefix_hit_tokens)

    # --- allocation -----------------------------------------------------------------------------

    def start(self, req: Request, n: int) -> bool:
        """Reuses the longest cached prefix of a request with nothing computed, then allocates for its
        first chunk of up to n tokens; or returns False having taken nothing."""
        hits: list[int] = []
        if self.prefix_caching and req.num_computed == 0 and not req.needs_prompt_logits:
            hits = self.pool.lookup(self._usable_hashes(req))
            self.pool.take(hits)
            req.blocks = list(hits)
            req.num_computed = len(hits) * self.block_size
            req.num_registered = len(hits)
        if self.grow(req, min(n, req.num_tokens - req.num_computed)):
            if not req.output_ids:  # first admission: report prompt tokens served from the cache
                req.num_cached = req.num_computed
                self.stats.prefix_query_tokens += len(req.prompt_ids)
                self.stats.prefix_hit_tokens += req.num_computed
            return True
        self.pool.free(hits)
        req.blocks, req.num_computed, req.num_registered = [], 0, 0
        return False

    def grow(self, req: Request, n: int) -> bool:
        """Gives `req` the blocks to hold n more tokens past `num_computed`, or returns False having
        taken none."""
        need = self.pool.blocks_for(req.num_computed + n) - len(req.blocks)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        req.blocks.extend(self.pool.allocate(need))
        return True

    def free(self, req: Request) -> None:
        """Returns every block a request holds, on the device and in the swap space."""
        self.pool.free(req.blocks)
        if req.swap_blocks:
            self.swap_pool.free(req.swap_blocks)
        req.blocks, req.swap_blocks = [], []

    # --- swap -----------------------------------------------------------------------------------

    def preempt(self, req: Request) -> tuple[list[int], list[int]] | None:
        """Frees a preempted request's device blocks. Where the swap space has room they are copied
        there first: returns (device, cpu) blocks for the runner to copy before the step; None: its KV
        is dropped, to be recomputed (the prefix cache may still hold its full blocks)."""
        copy = None
        swap = self.swap_pool
        if swap is not None and req.blocks and swap.can_allocate(len(req.blocks)):
            req.swap_blocks = swap.allocate(len(req.blocks))
            copy = (list(req.blocks), list(req.swap_blocks))
            self.stats.swapped_out_blocks += len(req.blocks)
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_registered = 0
        return copy

    def swap_in(self, req: Request, n: int) -> tuple[list[int], list[int]] | None:
        """Device blocks for a swapped request's KV and its next n tokens: returns (cpu, device) blocks
        for the runner to copy back (the CPU ones stay taken until `free_swap`), or None having taken
        nothing."""
        held = len(req.swap_blocks)
        if not self.pool.can_allocate(self.pool.blocks_for(req.num_computed + n)):  # held blocks + growth
            return None
        device = self.pool.allocate(held)
        copy = (list(req.swap_blocks), list(device))
        self.stats.swapped_in_blocks += held
        req.blocks, req.swap_blocks, req.num_registered = device, [], 0
        self.grow(req, n)  # (cannot fail: checked above with the held blocks)
        return copy

    def free_swap(self, cpu_blocks: list[int]) -> None:
        """Frees swap blocks whose content was copied back to the device."""
        self.swap_pool.free(cpu_blocks)

    # --- prefix cache ---------------------------------------------------------------------------

    def cache_full_blocks(self, req: Request, kept_drafts: list[int] = ()) -> None:
        """Offers the request's blocks that are full now (after `num_computed` advanced) to the prefix
        cache; `kept_drafts`: this step's drafts the model kept, computed but not yet in its output. Only
        blocks of tokens the host knows (a step in flight may have computed past them)."""
        full = min(req.num_computed, req.num_known + len(kept_drafts)) // self.block_size
        if self.prefix_caching and full > req.num_registered:
            self._hashes(req, full, kept_drafts)
            for idx in range(req.num_registered, full):
                self.pool.register(req.blocks[idx], req.block_hashes[idx])
            req.num_registered = full

    def prompt_blocks_to_compute(self, req: Request) -> list[bytes]:
        """The hashes of the full prompt blocks a running request has still to compute (and will cache)."""
        if not self.prefix_caching:
            return []
        full = len(req.prompt_ids) // self.block_size
        if req.num_registered >= full:
            return []
        return self._hashes(req, full)[req.num_registered:full]

    def blocks_in_prefill(self, running: Iterable[Request]) -> set[bytes]:
        """The hashes of the prompt blocks the running requests are computing now."""
        return {h for r in running for h in self.prompt_blocks_to_compute(r)}

    def next_uncached_block(self, req: Request) -> bytes | None:
        """The hash of the first block of a fresh request's reusable prefix that the cache lacks; None
        when it has them all (or caching is off)."""
        if not self.prefix_caching:
            return None
        hashes = self._usable_hashes(req)
        hits = len(self.pool.lookup(hashes))
        return hashes[hits] if hits < len(hashes) else None

    def _usable_hashes(self, req: Request) -> list[bytes]:
        """The hashes of the blocks a prefix hit may supply: full ones before the last token, which is
        always computed (its logits are sampled)."""
        usable = (req.num_known - 1) // self.block_size
        return self._hashes(req, usable)[:usable]

    def _hashes(self, req: Request, n_blocks: int, kept: list[int] = ()) -> list[bytes]:
        """The content hashes of the request's first n_blocks full blocks (computed once each); `kept`:
        tokens past the request's own, this step's kept drafts."""
        have = len(req.block_hashes)
        if n_blocks > have:
            parent = req.block_hashes[-1] if have else self._root_hash(req)
            start, end = have * self.block_size, n_blocks * self.block_size
            tokens = req.token_ids(start, end)
            if end > req.num_known:
                tokens = tokens + list(kept[max(0, start - req.num_known):end - req.num_known])
            req.block_hashes.extend(chain_hashes(parent, tokens, self.block_size, 0, n_blocks - have))
        return req.block_hashes

    def _root_hash(self, req: Request) -> bytes:
        registration = self.registration(req.adapter) if req.adapter is not None else 0
        return root_hash(self.model, req.adapter, registration, req.cache_salt)
