"""Token-budget scheduler: continuous batching with chunked prefill.

Each step grants tokens under `max_num_batched_tokens`: running requests first (their decodes and
unfinished prefill chunks), then waiting requests in arrival order while sequences and tokens
remain. When the KV pool runs short, the newest running request is preempted (its blocks are
freed and it is recomputed later), so the oldest always make progress.

A request for a LoRA adapter holds a device slot while it runs. A step never needs more distinct
adapters than there are slots: a waiting request whose adapter finds no free slot is passed over
(keeping its place at the head of the queue) until a running request releases one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.engine.kv.block_pool import BlockPool
from loraplex.engine.sched.request import Request, Status


@dataclass
class ScheduledBatch:
    """One step's work: (request, number of new tokens to compute) in batch order."""

    entries: list[tuple[Request, int]] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.entries

    def sampled(self) -> list[Request]:
        """Requests whose chunk reaches their last token, so this step samples their next one."""
        return [r for r, n in self.entries if r.num_computed + n == r.num_tokens]


class AdapterSlots(Protocol):
    def acquire(self, adapter_id: str) -> int | None: ...

    def release(self, adapter_id: str) -> None: ...


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.adapters: AdapterSlots | None = None  # set when the engine first registers an adapter
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, n):
                # Out of blocks: free the newest running request and retry; if that is this
                # request itself, it waits for the others to finish.
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                continue
            batch.entries.append((req, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(batch, budget)
        batch.num_tokens = self.max_num_batched_tokens - budget
        # Tokens of one adapter side by side: the LoRA kernels see few, long segments.
        batch.entries.sort(key=lambda e: e[0].lora_slot)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        """Moves waiting requests to running in arrival order while sequences, tokens and blocks last."""
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not self._take_adapter_slot(req):
                continue  # its adapter waits for a free slot; later requests may still run
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, n):
                self._drop_adapter_slot(req)
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            batch.entries.append((req, n))
            budget -= n
        return budget

    def _take_adapter_slot(self, req: Request) -> bool:
        if req.adapter is None:
            return True
        slot = self.adapters.acquire(req.adapter) if self.adapters is not None else None
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _drop_adapter_slot(self, req: Request) -> None:
        if req.adapter is not None and req.lora_slot >= 0:
            self.adapters.release(req.adapter)
            req.lora_slot = -1

    def _grow(self, req: Request, n: int) -> bool:
        """Gives `req` the blocks to hold n more tokens, or returns False having taken none."""
        need = self.pool.blocks_for(req.num_computed + n) - len(req.blocks)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        req.blocks.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_adapter_slot(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_cached = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Ends a request wherever it is and returns its blocks to the pool."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._drop_adapter_slot(req)
        else:
            self.waiting.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.status = Status.FINISHED
        req.finish_reason = reason
