"""EngineCore: one base model, its KV pool and scheduler; `step()` = schedule -> launch -> update.

With asynchronous scheduling (EngineConfig.async_scheduling) a step is scheduled and launched while the
step before it still runs on the device, and that one's results are applied after: the host's
scheduling overlaps the device's work, and the events a step returns are the previous step's.

Single-threaded by design: the async engine runs it on one background thread. `prepare()` (validation
and tokenization) touches no engine state, so callers may run it on their own thread and get errors
before anything is queued.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.engine.api import (
    PRIORITY_CLASSES,
    AdapterStats,
    EngineStats,
    GenerateEvent,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    ModelNotFoundError,
    ModelStats,
    RequestStats,
    SpeculationStats,
    TokenLogprob,
    Usage,
)
from loraplex.engine.attention.registry import attention_backend
from loraplex.engine.config import EngineConfig
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.frontend import RequestFrontend, max_model_len
from loraplex.engine.guided.masks import start_masks
from loraplex.engine.kv import smoothing
from loraplex.engine.kv.block_pool import BlockPool
from loraplex.engine.kv.manager import KVManager
from loraplex.engine.lora.merged import MergedAdapter
from loraplex.engine.lora.slots import LoraSlots
from loraplex.engine.memory import size_kv_cache
from loraplex.engine.models.llama import PROJECTIONS
from loraplex.engine.models.loader import LoadedModel, build_model, load_model, resolve_model
from loraplex.engine.runner import LaunchedStep, ModelRunner
from loraplex.engine.sampler import StepLogprobs
from loraplex.engine.sched.request import Request
from loraplex.engine.sched.scheduler import ScheduledBatch, Scheduler
from loraplex.engine.static_decode import StaticDecodeSpec, buckets_for, static_decode_mode


@dataclass
class Completion:
    """A finished request, gathered from its events (for the CLI, benchmarks and tests)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage


def _check_device(loaded: LoadedModel, want: torch.device) -> None:
    """Weights on another device than the config's would run there, or fail mid-step: refuse them."""
    have = {t.device for t in loaded.weights.values()}
    if len(have) != 1 or (dev := have.pop()).type != want.type or (want.index is not None and dev.index != want.index):
        raise ValueError(f"the engine is configured for device {want}, but the weights are on "
                         f"{', '.join(sorted(str(d) for d in {t.device for t in loaded.weights.values()}))}: "
                         f"load them there (load_model(..., device))")


def _check_act8(config: EngineConfig, model) -> None:
    """activation_dtype int8 with no GEMM to take it (no C kernels, or no projection in GGUF blocks) is refused."""
    if config.activation_dtype != "int8":
        return
    if not getattr(model.ops, "act8", False):
        raise ValueError("activation_dtype int8 needs the CPU C kernels (`loraplex doctor` says why they do not run)")
    if not any(getattr(getattr(layer, m), "act8", False) for layer in model.layers for m in PROJECTIONS):
        kinds = sorted({getattr(layer, m).kind for layer in model.layers for m in PROJECTIONS})
        raise ValueError(f"activation_dtype int8: no projection of {config.model} is in GGUF blocks (they are "
                         f"{', '.join(kinds)}): use weight_dtype int8 or int4, or activation_dtype float32")


def _adapters_of(requests) -> tuple[str, ...]:
    """The adapters `requests` ask for, each once and sorted (the gateway's LoRA gauge lists them)."""
    return tuple(sorted({r.adapter for r in requests if r.adapter}))


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        wdtype = config.weight_torch_dtype
        if loaded is None:
            loaded = load_model(resolve_model(config.model), config.torch_dtype, config.torch_device,
                                weight_dtype=wdtype, quant=config.weight_quant)
        elif wdtype != config.torch_dtype and loaded.rounded_to != wdtype:
            raise ValueError(f"weight_dtype {config.weight_dtype} needs weights loaded with weight_dtype={wdtype} "
                             f"(load_model), these were rounded to {loaded.rounded_to}")
        _check_device(loaded, config.torch_device)
        self.model_name = config.model
        self.loaded = loaded  # the weights as loaded (the pool's CPU tier keeps them on eviction)
        self.tokenizer = loaded.tokenizer
        self.token_bytes = self.tokenizer.token_bytes()
        device, dtype = loaded.weights["norm"].device, loaded.weights["norm"].dtype
        attention = attention_backend(config.attention_backend, device, dtype, loaded.config.head_dim,
                                      config.kv_torch_dtype)
        model = build_model(loaded, wdtype, attention, act8=config.activation_dtype == "int8")
        _check_act8(config, model)
        if config.kv_torch_dtype == torch.int8 and config.kv_cache_smoothing == "on":
            model.kv_smoothing = smoothing.calibrate(model, smoothing.calibration_prompts(loaded.tokenizer),
                                                     config.block_size)
        if model.w is not loaded.weights:  # (blocks became their panels: keep those, not a second copy)
            self.loaded = loaded = dataclasses.replace(loaded, weights=model.w)
        self.weight_bytes = model.resident_bytes()  # (what stats() reports)
        mcfg = loaded.config
        bs = config.block_size
        mode = static_decode_mode(config.cuda_graphs, device, attention.name)
        static = StaticDecodeSpec(mode, config.max_num_seqs * (1 + config.speculative_tokens),
                                  max_model_len(config, mcfg)) if mode else None
        # the KV pool: measured on CUDA unless sized (profiles a maximum-size step and, with decode graphs, the
        # largest bucket; engine/memory.py)
        graph_rows = buckets_for(static.max_rows)[-1] if mode == "graphs" else 0
        self.memory = size_kv_cache(config, model, self.weight_bytes, max_model_len(config, mcfg), graph_rows)
        num_blocks = self.memory.num_blocks
        self.frontend = RequestFrontend(config.model, loaded.tokenizer, mcfg, config, self._adapter_available,
                                        num_blocks)
        self.max_model_len = self.frontend.max_model_len
        self.pool = BlockPool(num_blocks, bs)
        swap_pool = None
        if config.preemption_mode == "swap":
            swap_blocks = max(1, config.swap_space_bytes // (bs * mcfg.kv_bytes_per_token(config.kv_torch_dtype)))
            swap_pool = BlockPool(swap_blocks, bs)
        # (a request's adapter stays registered while it is in the engine: remove_adapter waits for it)
        self.kv = KVManager(self.pool, model=config.model, swap_pool=swap_pool,
                            prefix_caching=config.enable_prefix_caching,
                            registration=lambda adapter_id: self.lora.registration(adapter_id))
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens,
            priority_weights=config.priority_weights, aging_s=config.priority_aging_s,
            speculative_tokens=config.speculative_tokens, speculative_max_seqs=config.speculative_max_seqs)
        self.runner = ModelRunner(model, num_blocks, bs, swap_pool.num_blocks if swap_pool else 0, static,
                                  kv_dtype=config.kv_torch_dtype)
        self.async_scheduling = config.async_scheduling_on
        self._in_flight: tuple[ScheduledBatch, LaunchedStep] | None = None  # launched, results not applied
        self.requests: dict[str, Request] = {}
        self.wake: Callable[[], None] = lambda: None  # set by the model pool: wakes its engine loop
        self._idle_at_reads: int | None = None  # reads_done when a step found only requests awaiting reads
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.lora: LoraSlots | None = None
        self._removing: set[str] = set()  # adapters to unregister once their requests finish
        self.num_steps = 0
        self.generated_tokens = 0
        self.prompt_tokens_computed = 0
        self.spec_draft_tokens = 0  # drafts verified (speculative decoding)
        self.spec_accepted_tokens = 0  # of which the model agreed with

    # --- admission -------------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return self.frontend.info()

    def prepare(self, req: GenerateRequest) -> Request:
        """Validates and tokenizes; raises EngineError (nothing is queued)."""
        return self.frontend.prepare(req)

    def _adapter_available(self, adapter_id: str) -> bool:
        return self.lora is not None and adapter_id in self.lora and adapter_id not in self._removing

    def add(self, r: Request) -> None:
        if r.request_id in self.requests:
            raise InvalidRequestError(f"request id {r.request_id!r} is already in flight", "request_id")
        self.requests[r.request_id] = r
        self._detok[r.request_id] = IncrementalDetokenizer(
            self.token_bytes, self.tokenizer.special_ids,
            skip_special_tokens=r.sampling.skip_special_tokens, stop=r.sampling.stop)
        self.scheduler.add(r)
        self._idle_at_reads = None  # (it may run at once)
        if r.adapter is not None and self.lora is not None:
            self.lora.prefetch(r.adapter)  # read in the background now: its first step finds it in the CPU tier

    # --- adapters ---------------------------------------------------------------------------

    def add_adapter(self, adapter_id: str, path: str, version: tuple | None = None) -> tuple:
        """Registers a PEFT adapter directory under `adapter_id`; validates it fully first
        (AdapterError names the bad field or tensor, and nothing changes: a bad first adapter leaves no
        slot buffers behind). Returns the files' version; given one, reads nothing now (LoraSlots.register)."""
        if self.lora is not None:
            return self.lora.register(adapter_id, path, version)
        cfg, model = self.config, self.runner.model
        lora = LoraSlots(model.config, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras,
                         model.dtype if cfg.lora_dtype == "auto" else cfg.lora_torch_dtype, model.device,
                         background=True)  # a step never waits for an adapter's disk read
        lora.on_read = lambda: self.wake()
        version = lora.register(adapter_id, path, version)
        self.lora = self.runner.lora_slots = self.scheduler.adapters = lora
        if cfg.lora_merge_after_steps:
            self.runner.lora_merge = MergedAdapter(model, lora, cfg.lora_merge_after_steps)
        return version

    def remove_adapter(self, adapter_id: str) -> bool:
        """Unregisters an adapter. New requests for it are refused at once; if requests still use
        it, it goes when the last one finishes. Returns True once it is gone."""
        if self.lora is None or adapter_id not in self.lora:
            raise ModelNotFoundError(f"adapter {adapter_id!r} not found", "adapter")
        self._removing.add(adapter_id)
        return self._reap_adapter(adapter_id)

    def pin_adapter(self, adapter_id: str) -> None:
        """Loads the adapter into a device slot that is never evicted."""
        if self.lora is None or adapter_id not in self.lora:
            raise ModelNotFoundError(f"adapter {adapter_id!r} not found", "adapter")
        self.lora.pin(adapter_id)

    def _reap_adapter(self, adapter_id: str) -> bool:
        if any(r.adapter == adapter_id for r in self.requests.values()):
            return False
        self._removing.discard(adapter_id)
        self.lora.unregister(adapter_id)
        return True

    def add_request(self, req: GenerateRequest) -> None:
        self.add(self.prepare(req))

    def abort(self, request_id: str) -> GenerateEvent | None:
        r = self.requests.get(request_id)
        if r is None:
            return None
        return self._finish(r, "abort", "")

    # --- the step --------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    def runnable(self) -> bool:
        """Whether a step would do something now: not while every waiting request waits on an adapter's
        background read and none has ended since the last step found nothing to run (the read's end calls
        `wake`, so an engine loop can sleep instead of spinning)."""
        if self._in_flight is not None:
            return True
        if self._idle_at_reads is not None and self.lora.reads_done == self._idle_at_reads:
            return False
        return self.has_work()

    def step(self) -> list[GenerateEvent]:
        """One step. The runner's StepOutput is its only result: the scheduler applies it (`update`),
        then each sampled request's tokens are appended to its output here, as its events are made
        (`_append`: a stop string, a schema or a limit may end it at any of them, dropping the rest)."""
        try:
            return self._step()
        except BaseException:
            self._in_flight = None  # (the pool ends this model's requests)
            raise

    def _step(self) -> list[GenerateEvent]:
        """Schedules and launches a step; applies the step in flight before it (asynchronous scheduling),
        first if the schedule needs its tokens on the host (`_overlaps`), else after the launch; without
        asynchronous scheduling, applies the new step at once."""
        events = []
        if self._in_flight is not None and not self._overlaps(self._in_flight[0]):
            events = self._apply_in_flight()
        batch = self.scheduler.schedule()
        failed = [self._finish(r, "error", "", error=f"adapter {r.adapter!r} cannot be loaded: {why}")
                  for r, why in self.scheduler.take_failed()]
        idle_on_reads = (batch.empty and not failed and self._in_flight is None and self.lora is not None
                         and self.lora.loading())
        self._idle_at_reads = self.lora.reads_done if idle_on_reads else None
        if batch.empty:
            return failed + events + self._apply_in_flight()
        sampled = batch.sampled()
        self.spec_draft_tokens += sum(len(r.spec_ids) for r in sampled)
        start_masks((r.guide for r in sampled if r.guide is not None), self.config.torch_device.type == "cpu")
        try:  # (the runner writes nothing onto the requests)
            launched = self.runner.launch(batch, self._in_flight[1] if self._in_flight is not None else None)
        except BaseException:  # the pool fails this model's requests; their swap space must not leak
            self.scheduler.release_swap_ins(batch)
            raise
        self.prompt_tokens_computed += sum(
            min(n, len(r.prompt_ids) - r.num_computed) for r, n in batch.entries if r.num_computed < len(r.prompt_ids))
        self.scheduler.commit(batch)
        self.num_steps += 1
        events += self._apply_in_flight()  # the previous step's, while this one runs
        self._in_flight = (batch, launched)
        if not self.async_scheduling:
            events += self._apply_in_flight()
        return failed + events

    def drain(self) -> list[GenerateEvent]:
        """Applies the step in flight, if any, and returns its events (for a caller that stops stepping)."""
        return self._apply_in_flight()

    def _overlaps(self, in_flight: ScheduledBatch) -> bool:
        """Whether the next step may be scheduled before the step in flight's tokens reach the host: not
        when a request it sampled needs its token on the host for its next step (a schema, penalties),
        nor when the scheduler may make drafts (an n-gram lookup over the output)."""
        return (self.async_scheduling and not self.scheduler.may_speculate()
                and not any(r.needs_host_tokens for r in in_flight.sampled() if not r.finished))

    def _apply_in_flight(self) -> list[GenerateEvent]:
        """Waits for the step in flight's tokens and applies them: update, then each sampled request's
        tokens to its output (a request that ended meanwhile, by a stop or an abort, loses its token)."""
        if self._in_flight is None:
            return []
        batch, launched = self._in_flight
        self._in_flight = None
        out = launched.output()
        self.scheduler.update(batch, out)
        return [self._append_all(req, toks, lps)
                for req, toks, lps in zip(batch.sampled(), out.tokens, out.logprobs, strict=True) if not req.finished]

    def _append_all(self, r: Request, tokens: list[int], steps: list[StepLogprobs | None]) -> GenerateEvent:
        """A step's new tokens for one request (several when drafts were kept) as one event; a token
        that ends the request ends it there, and any after it are dropped."""
        if r.max_tokens == 0:  # the prompt is computed (scored): nothing is generated
            return self._finish(r, "length", "", prompt_logprobs=self._prompt_logprobs(r))
        if len(tokens) == 1:
            return self._append(r, tokens[0], steps[0])
        self.spec_accepted_tokens += len(tokens) - 1
        events = []
        for token, step in zip(tokens, steps, strict=True):
            events.append(self._append(r, token, step))
            if events[-1].finished:
                break
        return dataclasses.replace(events[-1], text="".join(e.text for e in events),
                                   token_ids=tuple(t for e in events for t in e.token_ids),
                                   logprobs=tuple(lp for e in events for lp in e.logprobs),
                                   prompt_logprobs=events[0].prompt_logprobs)

    def _logprob(self, token: int, step: StepLogprobs | None) -> tuple[TokenLogprob, ...]:
        """The sampler's numbers for one token, with the token bytes the platform shows."""
        if step is None:
            return ()
        names = self.token_bytes
        return (TokenLogprob(token, names[token], step[0], tuple((i, names[i], lp) for i, lp in step[1])),)

    def _prompt_logprobs(self, r: Request) -> tuple[TokenLogprob, ...]:
        """Every prompt token's entry, for the first event: the first has no log-probability."""
        if r.prompt_logprobs is None or len(r.output_ids) > 1:
            return ()
        first = r.prompt_ids[0]
        entries = [TokenLogprob(first, self.token_bytes[first], None)]
        for token, step in zip(r.prompt_ids[1:], r.prompt_logprobs, strict=True):
            entries.extend(self._logprob(token, step))
        return tuple(entries)

    def _append(self, r: Request, token: int, step_logprobs: StepLogprobs | None = None) -> GenerateEvent:
        if r.guide is not None and r.guide.error is not None:  # its mask failed: the token is not its own
            return self._finish(r, "error", "", error=r.guide.error)
        now = time.monotonic()
        if r.first_token_time is None:
            r.first_token_time = now
        r.output_ids.append(token)
        self.generated_tokens += 1
        detok = self._detok[r.request_id]
        lps = {"logprobs": self._logprob(token, step_logprobs), "prompt_logprobs": self._prompt_logprobs(r)}
        if token in r.stop_ids:  # not part of the text: OpenAI reports no log-probability for it either
            return self._finish(r, "stop", detok.flush(), (token,), prompt_logprobs=lps["prompt_logprobs"])
        text = detok.push(token)
        if detok.stopped:
            return self._finish(r, "stop", text, (token,), **lps)
        if r.guide is not None:
            if not r.guide.accept(token):
                return self._finish(r, "error", text, (token,), **lps,
                                    error=f"token {token} was sampled outside the JSON schema's mask")
            if r.guide.complete:  # the schema's value is whole: nothing may follow, so stop without EOS
                return self._finish(r, "stop", text + detok.flush(), (token,), **lps)
        if len(r.output_ids) >= r.max_tokens or r.num_known >= self.max_model_len:
            return self._finish(r, "length", text + detok.flush(), (token,), **lps)
        return GenerateEvent(r.request_id, text, (token,), **lps)

    def _finish(self, r: Request, reason: str, text: str, token_ids: tuple[int, ...] = (),
                logprobs: tuple[TokenLogprob, ...] = (), prompt_logprobs: tuple[TokenLogprob, ...] = (),
                error: str | None = None) -> GenerateEvent:
        self.scheduler.finish(r, reason)
        del self.requests[r.request_id]
        del self._detok[r.request_id]
        if r.adapter in self._removing:
            self._reap_adapter(r.adapter)
        ttft = None if r.first_token_time is None else r.first_token_time - r.arrival
        usage = Usage(len(r.prompt_ids), len(r.output_ids), r.num_cached, ttft)
        return GenerateEvent(r.request_id, text, token_ids, reason, usage, error, logprobs, prompt_logprobs)

    def stats(self) -> EngineStats:
        """Each component's record: the scheduler's queues, the KV manager's, the adapter slots'."""
        sched = self.scheduler
        running = dict.fromkeys(PRIORITY_CLASSES, 0)
        running_requests, waiting = list(sched.running), list(sched.waiting)
        for r in running_requests:
            running[r.priority] += 1
        requests = RequestStats(
            running=sum(running.values()), waiting=len(waiting), running_by_class=running,
            waiting_by_class=sched.waiting.depth(), preemptions_by_class=dict(sched.counters.preemptions),
            swapped_requests=sum(1 for r in waiting if r.swap_blocks), num_steps=self.num_steps,
            generated_tokens=self.generated_tokens, prompt_tokens_computed=self.prompt_tokens_computed)
        merge = self.runner.lora_merge
        adapters = dataclasses.replace(
            self.lora.slot_stats() if self.lora else AdapterStats(), slots=self.config.max_loras,
            running=_adapters_of(running_requests), waiting=_adapters_of(waiting),
            merges=merge.builds if merge else 0, merged_bytes=merge.nbytes() if merge else 0)
        return EngineStats(requests=requests, kv=self.kv.cache_stats(), adapters=adapters,
                           speculation=SpeculationStats(self.spec_draft_tokens, self.spec_accepted_tokens),
                           models=ModelStats(weight_bytes=self.weight_bytes), memory=self.memory.stats())

    # --- synchronous convenience -----------------------------------------------------------

    def run(self, requests: list[GenerateRequest]) -> list[Completion]:
        """Adds every request, steps until all finish, returns them in the order given."""
        prepared = [self.prepare(r) for r in requests]  # all validated before any is queued
        for r in prepared:
            self.add(r)
        parts: dict[str, list] = {r.request_id: ["", [], None, None] for r in prepared}
        pending = len(prepared)
        while pending:
            for ev in self.step():
                p = parts.get(ev.request_id)
                if p is None:
                    continue
                p[0] += ev.text
                p[1].extend(ev.token_ids)
                if ev.finished:
                    p[2], p[3] = ev.finish_reason, ev.usage
                    pending -= 1
        return [Completion(rid, *parts[rid]) for rid in (r.request_id for r in prepared)]
