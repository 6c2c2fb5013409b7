"""Several base models under one device memory budget, multiplexed LRU.

- Tiers, fastest first: device (an EngineCore: weights on the device, its own KV pool, scheduler and
  adapter slots), CPU (the loaded weights in host memory, bounded by `cpu_budget_bytes`, LRU), disk (the
  source; GGUF weights from the loader's safetensors cache, memory-mapped).
- Every registered model keeps its tokenizer and limits, so requests for a model on disk are validated at
  once and queue while it loads. A load runs on a worker thread and never blocks the other models' steps.
- Making room evicts the least recently used idle model, never one with requests in flight or queued,
  and never a pinned one. A model counts its weights and KV pool, and from its first adapter on its
  adapter memory too (slot buffers; with the CPU kernels also folded and merged copies), for which
  `add_adapter` makes room or refuses.
- Adapters are registered per model and replayed into its engine whenever it is loaded, as they were
  registered and without reading them (each is read on its first request and must be the same files), so
  a reload does not grow with the fleet and an adapter whose files went away fails only its own requests.
- An evicted engine's counters (`api.ENGINE_COUNTERS`) are kept, so the engine's totals never go back.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from loraplex.engine.api import (
    EngineError,
    GenerateEvent,
    InvalidRequestError,
    ModelNotFoundError,
    Usage,
    add_stats,
    counters_of,
)
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.frontend import RequestFrontend, kv_blocks
from loraplex.engine.lora.peft import load_peft_adapter
from loraplex.engine.memory import (
    DEFAULT_KV_CACHE_BYTES,
    DeviceMemory,
    adapter_device_bytes,
    measure_device_memory,
    measures_kv_cache,
)
from loraplex.engine.models.layer_ops import resident_weight_bytes
from loraplex.engine.models.llama import LlamaConfig
from loraplex.engine.models.loader import LoadedModel, ModelSource, load_model, resolve_model
from loraplex.engine.sched.request import Request

TIERS = ("device", "cpu", "disk")

log = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    """A registered model and where it lives now."""

    name: str
    source: ModelSource
    config: EngineConfig
    model_config: LlamaConfig
    base_bytes: int  # weights + KV pool on the device
    adapter_bytes: int  # what its adapters add on the device once it has any (adapter_device_bytes)
    host_bytes: int  # weights in host memory (the CPU tier)
    pinned: bool = False
    frontend: RequestFrontend | None = None
    tier: str = "disk"
    core: EngineCore | None = None
    host: LoadedModel | None = None
    loading: Future | None = None
    pending: list[Request] = field(default_factory=list)  # requests waiting for the load
    # adapter id -> (PEFT directory, its files' version when registered): a reload registers them as they were
    adapters: dict[str, tuple[str, tuple]] = field(default_factory=dict)
    removing: set[str] = field(default_factory=set)
    last_used: float = 0.0  # when a request for it last arrived (LRU order)
    loads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    last_load_ms: dict[str, float] = field(default_factory=dict)
    evictions: int = 0
    load_error: str | None = None

    @property
    def busy(self) -> bool:
        return bool(self.pending) or (self.core is not None and self.core.has_work())

    @property
    def device_bytes(self) -> int:
        """What the model holds on the device when resident: its adapter memory counts from the first
        adapter on (a resident engine keeps its slot buffers until it is evicted)."""
        with_adapters = self.core.lora is not None if self.core is not None else bool(self.adapters)
        return self.base_bytes + (self.adapter_bytes if with_adapters else 0)


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


DEFAULT_BUDGET_FRACTION = 0.8  # of the host's memory, where the budget is not measured (the CPU)


class ModelPool:
    def __init__(self, memory_budget: int | float | None = None, cpu_budget_bytes: int = 8 << 30,
                 device: str = "auto", on_ready: Callable[[], None] | None = None,
                 gpu_memory_utilization: float = 0.9):
        """memory_budget: bytes, or a fraction (<= 1) of the device's memory; None: on CUDA measured,
        `gpu_memory_utilization` of the device less the memory in use now (engine/memory.py), on the CPU
        DEFAULT_BUDGET_FRACTION of the host's."""
        self.device = EngineConfig(device=device).torch_device
        # the measurement the budget came from (None where it was given, or on the CPU)
        self.memory: DeviceMemory | None = None
        if memory_budget is None and self.device.type == "cuda":
            self.memory = measure_device_memory(self.device, gpu_memory_utilization)
            self.budget = self.memory.budget
        else:
            fraction = DEFAULT_BUDGET_FRACTION if memory_budget is None else memory_budget
            total = device_memory_bytes(self.device)
            self.budget = int(fraction * total) if fraction <= 1 else int(fraction)
        self.cpu_budget = cpu_budget_bytes
        self.models: dict[str, ModelEntry] = {}
        # The counters (api.ENGINE_COUNTERS) of engines since evicted: the engine's totals add them.
        self.retired: dict = {}
        self.on_ready = on_ready or (lambda: None)  # called from the loader thread when a load ends
        self._lock = threading.RLock()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-model-load")

    # --- registry ------------------------------------------------------------------------------

    def register_model(self, name: str, source: str | None = None, *, config: EngineConfig | None = None,
                       pinned: bool = False) -> ModelEntry:
        """Registers `name` served from `source` (a catalog name, path or synthetic spec; default:
        the name itself). Reads config and tokenizer now: a corrupt source fails here, clearly."""
        if name in self.models:
            raise InvalidRequestError(f"model {name!r} is already registered", "model")
        src = resolve_model(source or name)
        cfg = replace(config or EngineConfig(), model=name, device=str(self.device))
        if measures_kv_cache(cfg):  # one model of several: a KV cache of its own size, not what the device has left
            cfg = replace(cfg, kv_cache_bytes=DEFAULT_KV_CACHE_BYTES)
        try:
            loaded = load_model(src, cfg.torch_dtype, torch.device("cpu"), weight_dtype=cfg.weight_torch_dtype,
                                quant=cfg.weight_quant)
        except (ValueError, OSError) as e:
            raise InvalidRequestError(f"model {name!r} cannot be loaded from {source or name}: {e}", "model") from e
        device_bytes, adapter_bytes, weight_bytes = self._sizes(cfg, loaded, cfg.torch_dtype,
                                                                kv_blocks(cfg, loaded.config), cfg.block_size)
        if device_bytes > self.budget:
            raise InvalidRequestError(
                f"model {name!r} needs {device_bytes / 2**20:.0f} MiB (weights + KV cache) but the "
                f"whole model memory budget is {self.budget / 2**20:.0f} MiB", "model")
        entry = ModelEntry(name, src, cfg, loaded.config, device_bytes, adapter_bytes, weight_bytes, pinned=pinned)
        entry.frontend = RequestFrontend(name, loaded.tokenizer, loaded.config, cfg,
                                         lambda a, e=entry: a in e.adapters and a not in e.removing)
        entry.frontend.guide_vocabulary()  # now, not on the first schema request's (event-loop) thread
        with self._lock:
            self.models[name] = entry
            self._to_host_tier(entry, loaded)
        return entry

    def _sizes(self, cfg: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, blocks: int,
               block_size: int) -> tuple[int, int, int]:
        """(weights + KV pool on the device, adapter memory once it has adapters, weights in host memory)."""
        model = loaded.config
        weight_bytes = sum(w.nbytes for w in loaded.weights.values())
        kv_bytes = blocks * block_size * model.kv_bytes_per_token(cfg.kv_torch_dtype)
        return (resident_weight_bytes(loaded.weights, self.device, dtype, cfg.weight_torch_dtype) + kv_bytes,
                adapter_device_bytes(cfg, model, self.device), weight_bytes)

    def unregister_model(self, name: str) -> None:
        entry = self.entry(name)
        with self._lock:
            if entry.busy or entry.loading is not None:
                raise InvalidRequestError(f"model {name!r} has requests in flight; retry when they finish", "model")
            self._evict(entry, keep_host=False)
            del self.models[name]

    def entry(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFoundError(f"model {name!r} not found", "model")
        return entry

    def pin(self, name: str, pinned: bool = True) -> None:
        """A pinned model is never evicted (it is loaded on its next request, or by `load`)."""
        self.entry(name).pinned = pinned

    # --- adapters ------------------------------------------------------------------------------

    def add_adapter(self, model: str, adapter_id: str, path: str) -> None:
        """Registers (and validates) an adapter of `model`. Its first adapter makes the model need its
        adapter memory too: refused when the budget can never hold both; when resident, idle models are
        evicted to make room now (refused, nothing registered, while busy or pinned ones fill it)."""
        entry = self.entry(model)
        with self._lock:
            if adapter_id in entry.adapters:
                raise InvalidRequestError(f"adapter {adapter_id!r} is already registered on {model!r}", "adapter")
            need = entry.base_bytes + entry.adapter_bytes
            if need > self.budget:
                raise InvalidRequestError(
                    f"adapters on model {model!r} need {entry.adapter_bytes / 2**20:.0f} MiB of adapter memory "
                    f"(max_loras {entry.config.max_loras} at max_lora_rank {entry.config.max_lora_rank}) beside "
                    f"its {entry.base_bytes / 2**20:.0f} MiB, but the whole model memory budget is "
                    f"{self.budget / 2**20:.0f} MiB", "adapter")
            if entry.core is not None and entry.core.lora is None and not self._make_room(entry.adapter_bytes, entry):
                raise InvalidRequestError(
                    f"no room for model {model!r}'s adapter memory ({entry.adapter_bytes / 2**20:.0f} MiB): busy "
                    f"or pinned models fill the model memory budget ({self.budget / 2**20:.0f} MiB); retry when "
                    f"they are idle", "adapter")
            if entry.core is not None:
                version = entry.core.add_adapter(adapter_id, path)  # validates
            else:
                version = load_peft_adapter(path, entry.model_config, entry.config.max_lora_rank).version  # validates
            entry.adapters[adapter_id] = (path, version)

    def remove_adapter(self, model: str, adapter_id: str) -> bool:
        """Refuses new requests for the adapter at once; True once it is gone (else when its
        running requests finish; `reap_adapters` completes it)."""
        entry = self.entry(model)
        if adapter_id not in entry.adapters:
            raise ModelNotFoundError(f"adapter {adapter_id!r} not found", "adapter")
        entry.removing.add(adapter_id)
        return self._reap(entry, adapter_id)

    def adapter_present(self, model: str, adapter_id: str) -> bool:
        entry = self.models.get(model)
        return entry is not None and adapter_id in entry.adapters

    def _reap(self, entry: ModelEntry, adapter_id: str) -> bool:
        core = entry.core
        if core is not None and adapter_id in (core.lora or ()) and not core.remove_adapter(adapter_id):
            return False
        if any(r.adapter == adapter_id for r in entry.pending):
            return False
        entry.adapters.pop(adapter_id, None)
        entry.removing.discard(adapter_id)
        return True

    def reap_adapters(self) -> None:
        for entry in self.models.values():
            for adapter_id in list(entry.removing):
                self._reap(entry, adapter_id)

    # --- requests ------------------------------------------------------------------------------

    def prepare(self, req, compile_schema: bool = True) -> tuple[ModelEntry, Request]:
        entry = self.entry(req.model)
        return entry, entry.frontend.prepare(req, compile_schema)

    def submit(self, entry: ModelEntry, req: Request) -> None:
        entry.last_used = time.monotonic()
        if entry.core is not None:
            entry.core.add(req)
        else:
            entry.pending.append(req)  # the next step starts its load

    def abort(self, request_id: str) -> GenerateEvent | None:
        for entry in list(self.models.values()):
            if entry.core is not None and request_id in entry.core.requests:
                return entry.core.abort(request_id)
            for r in entry.pending:
                if r.request_id == request_id:
                    entry.pending.remove(r)
                    return GenerateEvent(request_id, "", (), "abort", Usage(len(r.prompt_ids), 0))
        return None

    def in_flight(self) -> list[str]:
        ids = [r.request_id for e in self.models.values() for r in e.pending]
        for e in self.models.values():
            if e.core is not None:
                ids.extend(e.core.requests)
        return ids

    def has_work(self) -> bool:
        return any(e.busy for e in list(self.models.values()))

    def runnable(self) -> bool:
        """Whether `step` would do something now (False while the only work is a load in progress)."""
        for e in list(self.models.values()):
            if (e.core is not None and e.core.runnable()) or (e.loading is not None and e.loading.done()):
                return True
            if e.pending and e.loading is None:
                return True
        return False

    def adopt(self, core: EngineCore, pinned: bool = False) -> ModelEntry:
        """Registers an engine that is already built (resident) under its model name."""
        name = core.model_name
        if name in self.models:
            raise InvalidRequestError(f"model {name!r} is already registered", "model")
        mcfg = core.loaded.config
        sizes = self._sizes(core.config, core.loaded, core.runner.model.dtype, core.pool.num_blocks,
                            core.pool.block_size)
        entry = ModelEntry(name, resolve_model(name), core.config, mcfg, *sizes,
                           pinned=pinned, tier="device", core=core, last_used=time.monotonic())
        core.wake = lambda: self.on_ready()  # (on_ready is the engine loop's, set after the pool is made)
        # the engine's own KV pool bounds prompts (on CUDA it is measured, not the configured guess)
        entry.frontend = RequestFrontend(name, core.tokenizer, mcfg, core.config,
                                         lambda a, e=entry: a in e.adapters and a not in e.removing,
                                         core.pool.num_blocks)
        entry.frontend.guide_vocabulary()  # now, not on the first schema request's (event-loop) thread
        with self._lock:
            self.models[name] = entry
        return entry

    def step(self) -> list[GenerateEvent]:
        """Installs finished loads, starts waiting ones, and runs one step of every model with work. A
        model whose step raises (a fault in its forward pass) ends every request it holds with an error
        event and keeps serving; the other models' steps are not affected."""
        events = self._install_loads()
        for entry in list(self.models.values()):
            if entry.pending and entry.loading is None and entry.core is None:
                events.extend(self._start_load(entry))
            if entry.core is not None and entry.core.runnable():
                events.extend(_step_or_fail(entry.core))
        return events

    # --- loading and eviction ------------------------------------------------------------------------

    def load(self, name: str, timeout: float | None = None) -> None:
        """Makes the model resident now (blocking), evicting idle ones as needed."""
        entry = self.entry(name)
        self._start_load(entry)
        if entry.loading is not None:
            entry.loading.result(timeout)
        self._install_loads()
        if entry.core is None:
            raise EngineError(entry.load_error or f"model {name!r} could not be loaded: no room in the budget")

    def unload(self, name: str) -> None:
        entry = self.entry(name)
        with self._lock:
            if entry.busy:
                raise InvalidRequestError(f"model {name!r} has requests in flight", "model")
            self._evict(entry, keep_host=True)

    def _start_load(self, entry: ModelEntry) -> list[GenerateEvent]:
        with self._lock:
            if entry.core is not None or entry.loading is not None:
                return []
            if not self._make_room(entry.device_bytes, keep=entry):
                if any(e.busy for e in self.models.values() if e is not entry):
                    return []  # waits: a busy model will go idle and make room
                # Only pinned (or loading) models hold the budget: nothing will ever make room.
                error = (f"model {entry.name!r} cannot be loaded: pinned models fill the model memory budget "
                         f"({self.budget / 2**20:.0f} MiB)")
                return self._fail_pending(entry, error)
            tier = "cpu" if entry.host is not None else "disk"
            entry.tier = "loading"
            entry.loading = self._loader.submit(self._build, entry, tier)
            entry.loading.add_done_callback(lambda _f: self.on_ready())
            return []

    def _fail_pending(self, entry: ModelEntry, error: str) -> list[GenerateEvent]:
        events = [GenerateEvent(r.request_id, "", (), "error", Usage(len(r.prompt_ids), 0), error)
                  for r in entry.pending]
        entry.pending.clear()
        return events

    def _build(self, entry: ModelEntry, tier: str) -> EngineCore:
        t0 = time.perf_counter()
        host = entry.host or load_model(entry.source, entry.config.torch_dtype, torch.device("cpu"),
                                        weight_dtype=entry.config.weight_torch_dtype, quant=entry.config.weight_quant)
        loaded = host if self.device.type == "cpu" else replace(
            host, weights={k: v.to(self.device) for k, v in host.weights.items()})
        core = EngineCore(entry.config, loaded=loaded)
        core.wake = lambda: self.on_ready()  # an adapter read ended: the engine loop may run it
        for adapter_id, (path, version) in entry.adapters.items():
            # read on their first requests: a reload costs the same whatever the fleet, and an adapter whose
            # files went away fails its own requests, not the model's load
            core.add_adapter(adapter_id, path, version)
        entry.loads[tier] += 1
        entry.last_load_ms[tier] = (time.perf_counter() - t0) * 1000
        return core

    def _install_loads(self) -> list[GenerateEvent]:
        events: list[GenerateEvent] = []
        with self._lock:
            for entry in list(self.models.values()):
                if entry.loading is None or not entry.loading.done():
                    continue
                future, entry.loading = entry.loading, None
                try:
                    entry.core = future.result()
                except Exception as e:  # the model cannot load: its waiting requests end with an error
                    entry.load_error = f"model {entry.name!r} failed to load: {e}"
                    entry.tier = "cpu" if entry.host is not None else "disk"
                    events.extend(self._fail_pending(entry, entry.load_error))
                    continue
                entry.tier, entry.load_error = "device", None
                for r in entry.pending:
                    entry.core.add(r)
                entry.pending.clear()
        return events

    def _resident_bytes(self) -> int:
        return sum(e.device_bytes for e in self.models.values() if e.core is not None or e.loading is not None)

    def _make_room(self, need: int, keep: ModelEntry) -> bool:
        """Evicts idle, unpinned models, least recently used first, until `need` bytes fit."""
        while self._resident_bytes() + need > self.budget:
            idle = [e for e in self.models.values()
                    if e is not keep and e.core is not None and not e.busy and not e.pinned]
            if not idle:
                return False
            self._evict(min(idle, key=lambda e: e.last_used), keep_host=True)
        return True

    def _evict(self, entry: ModelEntry, keep_host: bool) -> None:
        if entry.core is None:
            return
        core, entry.core = entry.core, None
        retired = copy.deepcopy(self.retired)
        add_stats(retired, counters_of(core.stats()))
        self.retired = retired  # replaced whole: stats() on another thread reads the old or the new one
        entry.evictions += 1
        self._to_host_tier(entry, core_weights(core) if keep_host else None)

    def _to_host_tier(self, entry: ModelEntry, loaded: LoadedModel | None) -> None:
        """Keeps the weights in host memory if the CPU budget allows (evicting LRU there), else disk."""
        entry.host, entry.tier = None, "disk"
        if loaded is None or entry.host_bytes > self.cpu_budget:
            return
        while self._host_bytes() + entry.host_bytes > self.cpu_budget:
            lru = min((e for e in self.models.values() if e.host is not None and e.core is None),
                      key=lambda e: e.last_used, default=None)
            if lru is None:
                return
            lru.host, lru.tier = None, "disk"
        entry.host = replace(loaded, weights={k: v.to("cpu") for k, v in loaded.weights.items()})
        entry.tier = "cpu"

    def _host_bytes(self) -> int:
        return sum(e.host_bytes for e in self.models.values() if e.host is not None)

    def stats(self) -> dict[str, dict]:
        return {name: {"tier": e.tier, "pinned": e.pinned, "loads": dict(e.loads), "evictions": e.evictions,
                       "last_load_ms": dict(e.last_load_ms), "device_bytes": e.device_bytes,
                       "pending": len(e.pending)} for name, e in self.models.items()}

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)


def _step_or_fail(core: EngineCore) -> list[GenerateEvent]:
    """One step of `core`; if it raises, every request it held ends with an error event that bills
    what it had generated (its KV blocks and adapter slot freed), including one the failed step had
    already finished, whose own event was lost with the step."""
    held = dict(core.requests)
    try:
        return core.step()
    except Exception as exc:
        log.exception("engine step of model %r failed", core.model_name)
        error = f"engine error: {type(exc).__name__}: {exc}"
        events = []
        for rid, r in held.items():
            ended = core.abort(rid) if rid in core.requests else None
            if ended is None:
                ttft = None if r.first_token_time is None else r.first_token_time - r.arrival
                ended = GenerateEvent(rid, usage=Usage(len(r.prompt_ids), len(r.output_ids), r.num_cached, ttft))
            events.append(replace(ended, text="", token_ids=(), finish_reason="error", error=error))
        return events


def core_weights(core: EngineCore) -> LoadedModel:
    """The weights an engine was built from (what the CPU tier keeps)."""
    return core.loaded
