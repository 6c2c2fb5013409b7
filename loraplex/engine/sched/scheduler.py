"""Token-budget scheduler: who runs each step, with how many tokens and drafts, and whom to preempt.

Policy only: the KV blocks, prefix hashes and their counters are the KV manager's (kv/manager.py).
- Tokens: each step grants under `max_num_batched_tokens`, running requests first (highest class, oldest
  first: decodes and unfinished prefill chunks), then waiting ones in weighted class order (queues.py)
  while sequences and tokens remain.
- Preemption: when the KV pool runs short, the lowest class's newest running request is preempted:
  recompute (blocks freed, prefilled again later, mostly from the prefix cache) or swap (blocks copied to
  a CPU swap space and back, when it has room). A step that preempts for blocks admits nobody. A waiting
  request may also preempt running requests of a lower class for a sequence slot or blocks. The runner
  copies swap-outs before swap-ins; swap space freed by a swap-in is reused only after the step.
- Shared prefixes: a waiting request whose next uncached prompt block a running request is computing now
  waits, keeping its place, and then takes it from the cache, so a prefix that several requests bring at
  once (an `n > 1` request's choices, a cold fleet's system prompt) is computed once.
- Speculative decoding (`speculative_tokens` > 0, while at most `speculative_max_seqs` run, and only when
  every decoding request has drafts): a request that may speculate (`Request.can_speculate`) gets an
  n-gram lookup's tokens (ngram.py) as drafts after its last token; `update` counts as computed only
  those the sampler kept (the rejected drafts' KV lies past `num_computed`, to be overwritten).
- Asynchronous scheduling: `commit(batch)` counts a laid-out batch's tokens as computed and gives each
  sampled request a pending token, so the next step can be scheduled before this one's tokens reach the
  host; a request whose pending token reaches max_tokens is not scheduled again. `update(batch, output)`
  then applies the StepOutput (step_output.py): rejected drafts, prompt log-probabilities, newly full
  blocks to the prefix cache. The runner and the sampler write nothing onto requests.
- Adapters: a LoRA request holds a device slot while it runs; a waiting request whose adapter finds no
  free slot is passed over (keeping its place) until one is released. A request whose adapter cannot be
  loaded at all (its files changed or vanished since registration) is handed back through `take_failed`
  with the reason, for the engine to end with an error; the others run on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from loraplex.engine.api import PRIORITY_CLASSES, EngineError
from loraplex.engine.kv.manager import KVManager
from loraplex.engine.sched.ngram import propose
from loraplex.engine.sched.queues import RANK, PriorityQueues
from loraplex.engine.sched.request import Request, Status

if TYPE_CHECKING:
    from loraplex.engine.step_output import StepOutput


@dataclass
class ScheduledBatch:
    """One step's work: (request, number of new tokens to compute) in batch order, and the KV block
    copies the runner must do before the forward pass."""

    entries: list[tuple[Request, int]] = field(default_factory=list)
    num_tokens: int = 0
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (device, cpu) blocks
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (cpu, device) blocks
    committed: list[Request] | None = None  # sampled() as it was when `Scheduler.commit` counted the batch

    @property
    def empty(self) -> bool:
        return not self.entries

    def sampled(self) -> list[Request]:
        """Requests whose chunk reaches their last token (and their drafts), so this step samples their
        next token(s); once committed, those it had then (commit advances num_computed)."""
        if self.committed is not None:
            return self.committed
        return [r for r, n in self.entries if r.num_computed + n >= r.num_tokens]


class AdapterSlots(Protocol):
    def acquire(self, adapter_id: str) -> int | None: ...

    def release(self, adapter_id: str) -> None: ...


@dataclass
class SchedulerCounters:
    """Preemptions by priority class, since start (the KV counters are KVManager.stats)."""

    preemptions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_CLASSES, 0))


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int, *,
                 priority_weights: tuple[float, ...] = (10.0, 5.0, 1.0), aging_s: float = 30.0,
                 speculative_tokens: int = 0, speculative_max_seqs: int = 8):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speculative_tokens = speculative_tokens
        self.speculative_max_seqs = speculative_max_seqs
        self.adapters: AdapterSlots | None = None  # set when the engine first registers an adapter
        self.waiting = PriorityQueues(priority_weights, aging_s)
        self.running: list[Request] = []
        self.counters = SchedulerCounters()
        self._admitted_now: set[int] = set()  # ids of requests admitted during the current schedule()
        self._in_prefill: set[bytes] = set()  # hashes of the prompt blocks running requests are computing
        self._failed: list[tuple[Request, str]] = []  # (request, why) whose adapter could not be loaded

    @property
    def num_preemptions(self) -> int:
        return sum(self.counters.preemptions.values())

    def add(self, req: Request) -> None:
        self.waiting.add(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def may_speculate(self) -> bool:
        """Whether the next schedule may give drafts (it reads every decoding request's output)."""
        return self.speculative_tokens > 0 and len(self.running) <= self.speculative_max_seqs

    def take_failed(self) -> list[tuple[Request, str]]:
        """The waiting requests the last schedule() found unservable (their adapter failed to load), with
        why; the caller ends them (finish)."""
        failed, self._failed = self._failed, []
        return failed

    # --- one step -------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self._admitted_now: set[int] = set()
        self.running.sort(key=lambda r: (RANK[r.priority], r.arrival))
        preempted = False
        drafts = self._batch_drafts()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.ends_with_pending:  # its last token is in flight: it ends when that lands
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            req.spec_ids = drafts.get(id(req), [])[:budget - n]
            if req.spec_ids and not self.kv.grow(req, n + len(req.spec_ids)):
                req.spec_ids = []  # no blocks to spare for guesses
            n += len(req.spec_ids)
            if not self.kv.grow(req, n):
                # Out of blocks: preempt the lowest class's newest (the sort put it last) and retry;
                # if that is this request itself, the ones after it in the list are tried next.
                self._preempt(self.running[-1], batch)
                preempted = True
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

    def release_swap_ins(self, batch: ScheduledBatch) -> None:
        """Frees the CPU swap blocks of the batch's swap-ins, once (their requests now hold device blocks):
        by update() after the step ran, or by the core when the step failed and update() never runs."""
        for cpu_ids, _ in batch.swap_in:
            self.kv.free_swap(cpu_ids)
        batch.swap_in = []

    def commit(self, batch: ScheduledBatch) -> None:
        """Counts a laid-out batch as computed before its results exist: each request advances by its
        tokens (drafts included; `update` takes back the rejected ones) and each sampled one holds a
        pending token until `update`, so the next step can be scheduled while this one runs."""
        batch.committed = batch.sampled()
        for req, n in batch.entries:
            req.num_computed += n
        for req in batch.committed:
            req.num_pending += 1

    def update(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Records a committed batch's results, from the runner's output alone: takes back the drafts the
        model did not keep, records prompt log-probabilities, and caches newly full blocks. A request that
        ended meanwhile is skipped; one preempted meanwhile keeps its token. (The core appends the sampled
        tokens to the requests' output after this.)"""
        self.release_swap_ins(batch)  # copied back now: the swap space may reuse them
        sampled = batch.sampled()
        rejected = {id(r): k for r, k in zip(sampled, output.num_rejected, strict=True)}
        for req in sampled:
            if not req.finished:
                req.num_pending -= 1
        for req, step in output.prompt_logprobs:
            if not req.finished:
                req.prompt_logprobs.append(step)
        for req, _ in batch.entries:
            if req.status is not Status.RUNNING:  # ended, or preempted after this step was scheduled
                continue
            k = rejected.get(id(req), 0)
            req.num_computed -= k
            kept = req.spec_ids[:len(req.spec_ids) - k]  # join the output after this
            req.spec_ids = []
            self.kv.cache_full_blocks(req, kept)

    # --- admission ------------------------------------------------------------------------------

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        """Moves waiting requests to running in weighted class order while sequences, tokens and
        blocks last. A request that finds no room may preempt running requests of a lower class."""
        self._in_prefill = self.kv.blocks_in_prefill(self.running) if self.waiting else set()
        for req in list(self.waiting.in_admission_order()):
            if budget <= 0:
                break
            if req.num_pending:
                continue  # preempted while its token was in flight: admitted once it lands
            if self._awaits_prefix(req):
                continue  # a running request is computing its next block: it takes it from the cache
            while len(self.running) >= self.max_num_seqs and (freed := self._make_room(req, batch)) is not None:
                budget += freed
            if len(self.running) >= self.max_num_seqs:
                continue  # nothing below its class to displace; a higher class further on may be
            if not self._take_adapter_slot(req):
                continue  # its adapter waits for a free slot; later requests may still run
            while not (ok := self._place(req, budget, batch)) and (freed := self._make_room(req, batch)) is not None:
                budget += freed
            if not ok:
                self._drop_adapter_slot(req)
                break
            self.waiting.remove(req)
            self.waiting.admitted(req)
            req.status = Status.RUNNING
            self.running.append(req)
            self._admitted_now.add(id(req))
            self._in_prefill.update(self.kv.prompt_blocks_to_compute(req))
            n = min(budget, req.num_tokens - req.num_computed)
            batch.entries.append((req, n))
            budget -= n
        return budget

    def _batch_drafts(self) -> dict[int, list[int]]:
        """Drafts by request (id) for this step: while few enough run, and only if every decoding
        request has some. A batch takes as many steps as its slowest request, so drafts beside a
        request that has none cost their rows and save no step."""
        if not self.may_speculate():
            return {}
        drafts = {}
        for req in self.running:
            if req.num_computed != req.num_tokens - 1:
                continue  # prefilling: it samples no token this step anyway
            guess = self._drafts(req)
            if not guess:
                return {}
            drafts[id(req)] = guess
        return drafts

    def _drafts(self, req: Request) -> list[int]:
        """Guesses at a decoding request's next tokens, within its max_tokens."""
        k = min(self.speculative_tokens, req.max_tokens - len(req.output_ids) - 1)
        return propose(req.prompt_ids + req.output_ids, k) if k > 0 and req.can_speculate else []

    def _awaits_prefix(self, req: Request) -> bool:
        """A fresh request whose first block missing from the cache is being computed by a running one."""
        if not self._in_prefill or req.num_computed or req.status is not Status.WAITING or req.needs_prompt_logits:
            return False
        return self.kv.next_uncached_block(req) in self._in_prefill

    def _place(self, req: Request, budget: int, batch: ScheduledBatch) -> bool:
        """Gives an admitted request its blocks for up to `budget` tokens (back from the swap space, or
        fresh with any cached prefix), or returns False having taken none."""
        n = min(req.num_tokens - req.num_computed, budget)
        if req.status is not Status.SWAPPED:
            return self.kv.start(req, n)
        copy = self.kv.swap_in(req, n)
        if copy is not None:
            batch.swap_in.append(copy)  # its CPU blocks are freed in update()
        return copy is not None

    def _make_room(self, req: Request, batch: ScheduledBatch) -> int | None:
        """Preempts the newest running request of the lowest class below req's; returns the tokens
        its cancelled work gave back to the step budget, or None when there is nobody to preempt."""
        # Never one admitted in this very step (its swap-in copy has not happened yet), nor one that
        # has aged past the starvation bound: it has waited long enough.
        now = time.monotonic()
        below = [r for r in self.running
                 if RANK[r.priority] > RANK[req.priority] and id(r) not in self._admitted_now
                 and now - r.arrival < self.waiting.aging_s]
        if not below:
            return None
        victim = max(below, key=lambda r: (RANK[r.priority], r.arrival))
        freed = 0
        for i, (r, n) in enumerate(batch.entries):
            if r is victim:
                del batch.entries[i]
                freed = n
                break
        self._preempt(victim, batch)
        return freed

    def _take_adapter_slot(self, req: Request) -> bool:
        if req.adapter is None:
            return True
        try:
            slot = self.adapters.acquire(req.adapter) if self.adapters is not None else None
        except EngineError as exc:  # e.g. its directory vanished since registration: this request fails
            self._failed.append((req, exc.message))
            return False
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _drop_adapter_slot(self, req: Request) -> None:
        if req.adapter is not None and req.lora_slot >= 0:
            self.adapters.release(req.adapter)
            req.lora_slot = -1

    # --- preemption and finishing ------------------------------------------------------------

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        req.spec_ids = []
        self._drop_adapter_slot(req)
        copy = self.kv.preempt(req)
        if copy is not None:
            batch.swap_out.append(copy)
            req.status = Status.SWAPPED
        else:  # recompute: its tokens stay known; the prefix cache may still hold its blocks
            req.num_computed = 0
            req.status = Status.WAITING
        req.num_preemptions += 1
        self.counters.preemptions[req.priority] += 1
        self.waiting.add(req, front=True)

    def finish(self, req: Request, reason: str) -> None:
        """Ends a request wherever it is and returns its blocks to the pools."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._drop_adapter_slot(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
