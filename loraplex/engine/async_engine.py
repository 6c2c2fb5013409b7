"""AsyncEngine: runs a ModelPool (one or more base models) on a background thread, bridged to asyncio.

- The engine loop owns the engines; callers only post commands (add, abort, remove adapter) to its inbox.
  Torch releases the GIL inside its kernels, so the event loop stays responsive while a step runs.
- `prepare()` validates and tokenizes on a small pool of its own threads (PREPARE_THREADS, named
  `loraplex-prepare`), never on the caller's event loop, so one huge prompt holds at most one of them;
  `generate()` of the request it returns validates again (cheap: the tokens are there) and raises before
  anything is queued.
- A step that raises ends the requests it held with an error event, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from loraplex.engine.api import (
    PRIORITY_CLASSES,
    ComputePath,
    EngineStats,
    GenerateEvent,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    ReplicaInfo,
    Usage,
    add_stats,
    keep_maxima,
)
from loraplex.engine.compute import local_compute_path
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.frontend import FrontendSpec
from loraplex.engine.pool import ModelPool

log = logging.getLogger(__name__)

# Threads that validate and tokenize requests (chat template, tokenizer, JSON-schema compile). Few and
# bounded: a hostile prompt takes one of them, never the event loop, and never a thread per request.
PREPARE_THREADS = 2


class AsyncEngine:
    """An `EngineClient` over an in-process ModelPool."""

    def __init__(self, engine: ModelPool | EngineCore):
        if isinstance(engine, EngineCore):
            pool = ModelPool(memory_budget=1.0, device=str(engine.config.torch_device))
            pool.adopt(engine)
            engine = pool
        self.pool = engine
        self.pool.on_ready = self._notify
        self.default_model = next(iter(self.pool.models), None)
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._removals: list[tuple[str, str, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._stopping = False
        self._compute_path: ComputePath | None = None
        self._preparer = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="loraplex-prepare")
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(EngineCore(config))

    @property
    def core(self) -> EngineCore | None:
        """The default model's engine while it is resident."""
        return self.pool.models[self.default_model].core if self.default_model else None

    # --- EngineClient ------------------------------------------------------------------------

    def models(self) -> list[ModelInfo]:
        return [e.frontend.info() for e in list(self.pool.models.values())]

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        if self._stopping:
            raise RuntimeError("engine is shut down")
        return await asyncio.get_running_loop().run_in_executor(self._preparer, self._tokenized, request)

    def _tokenized(self, request: GenerateRequest) -> GenerateRequest:
        """On a preparer thread: the request validated, with its prompt as token ids."""
        return self.pool.entry(request.model).frontend.tokenized(request)

    def frontend_specs(self) -> list[FrontendSpec]:
        """What rebuilds each model's request validation in another process (a gateway before Ray Serve replicas)."""
        return [e.frontend.spec(e.source) for e in list(self.pool.models.values())]

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """Streams the request's events; validates (and, unless it comes from prepare(), tokenizes) on
        the caller's thread first, raising EngineError before anything is queued.

        A tokenized request (from prepare(), or given as token ids) does not compile its JSON schema here, on
        the caller's event loop, where a compile would hold every other request on it: prepare() compiled
        it, and if other schemas have since pushed it out of the cache, EngineUnavailableError (503: retry). So a
        caller that gives token ids and a schema prepares it first, as the platform and the replicas do."""
        if self._stopping:
            raise RuntimeError("engine is shut down")
        entry, prepared = self.pool.prepare(request, compile_schema=request.prompt_token_ids is None)
        rid = request.request_id
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in flight", "request_id")
        queue: asyncio.Queue[GenerateEvent] = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), queue)
        self._post("add", (entry, prepared))
        return self._stream(rid, queue)

    async def _stream(self, rid: str, queue: asyncio.Queue) -> AsyncIterator[GenerateEvent]:
        finished = False
        try:
            while True:
                event = await queue.get()
                finished = event.finished
                yield event
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (disconnect, cancel): free its KV blocks
                self._post("abort", rid)

    async def abort(self, request_id: str) -> Usage | None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._post("abort", (request_id, loop, done))
        return await done

    def has_adapter(self, adapter_id: str, base_model: str | None = None) -> bool:
        return self.pool.adapter_present(base_model or self.default_model, adapter_id)

    def add_adapter(self, adapter_id: str, path: str, base_model: str | None = None) -> None:
        """Validates and registers a PEFT directory on `base_model` (default: the first model);
        raises AdapterError and changes nothing when it is bad."""
        self.pool.add_adapter(base_model or self.default_model, adapter_id, path)

    async def remove_adapter(self, adapter_id: str, base_model: str | None = None) -> None:
        """Returns once the adapter is gone; new requests for it are refused at once, running
        ones finish first."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._post("remove", (base_model or self.default_model, adapter_id, loop, done))
        await done

    def stats(self) -> EngineStats:
        """Totals over the resident models' engines, and the counters of those since evicted."""
        cores = [e.core for e in list(self.pool.models.values()) if e.core is not None]
        total: dict = {"requests": {k: dict.fromkeys(PRIORITY_CLASSES, 0)
                                    for k in ("running_by_class", "waiting_by_class", "preemptions_by_class")}}
        per_core = [core.stats().as_dict() for core in cores]
        for stats in per_core:
            add_stats(total, stats)
        add_stats(total, self.pool.retired)  # (totals since start survive a model's eviction)
        # settings and peaks, not sums: the utilization asked, the largest step; several models share the pool's budget
        keep_maxima(total, per_core)
        memory = total.setdefault("memory", {})
        memory["budget_bytes"] = self.pool.budget if len(self.pool.models) > 1 else max(
            (stats["memory"]["budget_bytes"] for stats in per_core), default=0)
        entries = list(self.pool.models.values())
        total["requests"]["waiting"] = total["requests"].get("waiting", 0) + sum(len(e.pending) for e in entries)
        add_stats(total, {"adapters": {"waiting": [r.adapter for e in entries for r in list(e.pending) if r.adapter]}})
        total["models"] = {**total.get("models", {}), "resident": len(cores),
                           "loads": sum(sum(e.loads.values()) for e in entries),
                           "evictions": sum(e.evictions for e in entries)}
        return EngineStats.from_dict(total)

    def compute_path(self) -> ComputePath:
        if self._compute_path is None:  # (cached: the answer holds for the process)
            self._compute_path = local_compute_path(str(self.pool.device))
        return self._compute_path

    def replicas(self) -> list[ReplicaInfo]:
        return []  # (the engine runs here)

    # --- models (blocking calls: they read weights; from async code run them in a thread) ---------

    def register_model(self, name: str, source: str | None = None, *, config: EngineConfig | None = None,
                       pinned: bool = False) -> None:
        self.pool.register_model(name, source, config=config, pinned=pinned)
        self.default_model = self.default_model or name

    def unregister_model(self, name: str) -> None:
        self.pool.unregister_model(name)

    def load(self, name: str) -> None:
        self.pool.load(name)

    def unload(self, name: str) -> None:
        self.pool.unload(name)

    def pin(self, name: str, pinned: bool = True) -> None:
        self.pool.pin(name, pinned)

    def model_stats(self) -> dict[str, dict]:
        """Per model: tier (device, cpu, disk, loading), loads and evictions, last load time per tier."""
        return self.pool.stats()

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self._preparer.shutdown(wait=False, cancel_futures=True)
        self.pool.shutdown()

    # --- the engine thread -----------------------------------------------------------------------

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _post(self, kind: str, payload: object) -> None:
        with self._wake:
            self._inbox.append((kind, payload))
            self._wake.notify()

    def _deliver(self, event: GenerateEvent) -> None:
        target = self._streams.get(event.request_id)
        if event.finished:
            self._streams.pop(event.request_id, None)
        if target is not None:
            loop, queue = target
            with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, event)

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                entry, prepared = payload
                if prepared.request_id in self._streams:
                    try:
                        self.pool.submit(entry, prepared)
                    except Exception as exc:  # (nothing of it was queued)
                        self._deliver(GenerateEvent(prepared.request_id, "", (), "error", Usage(0, 0), str(exc)))
            elif kind == "remove":
                model, adapter_id, loop, done = payload
                try:
                    self.pool.remove_adapter(model, adapter_id)
                    self._removals.append((model, adapter_id, loop, done))
                except Exception as exc:
                    loop.call_soon_threadsafe(_settle, done, exc)
            else:  # abort: from abort() (with a future for its usage) or from a closed stream
                rid, loop, done = payload if isinstance(payload, tuple) else (payload, None, None)
                try:
                    event = self.pool.abort(rid)
                except Exception as exc:
                    log.exception("abort of %s failed", rid)
                    event = GenerateEvent(rid, "", (), "error", Usage(0, 0), f"engine error: {exc}")
                if event is not None:
                    self._deliver(event)
                else:
                    self._streams.pop(rid, None)
                if done is not None:
                    loop.call_soon_threadsafe(_settle, done, None, event.usage if event else None)
        self._settle_removals()

    def _settle_removals(self) -> None:
        if not self._removals:
            return
        self.pool.reap_adapters()
        still = []
        for model, adapter_id, loop, done in self._removals:
            if self.pool.adapter_present(model, adapter_id):
                still.append((model, adapter_id, loop, done))
            else:
                loop.call_soon_threadsafe(_settle, done, None)
        self._removals = still

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._inbox and not self.pool.runnable():
                    self._wake.wait()
                if self._stopping:
                    break
            try:
                self._drain_inbox()
                events = self.pool.step()  # (a model whose step fails ends its own requests there)
            except Exception as exc:  # anything else must not leave requests hanging, nor end this thread
                log.exception("engine loop failed")
                events = self._fail_all(exc)
            for event in events:
                self._deliver(event)
            try:
                self._settle_removals()
            except Exception:
                log.exception("adapter removal failed")
        for event in self._fail_all(RuntimeError("engine shut down")):
            self._deliver(event)

    def _fail_all(self, exc: Exception) -> list[GenerateEvent]:
        """Ends every request in the engine with an error event billing what it generated."""
        events = []
        for rid in self.pool.in_flight():
            try:
                aborted = self.pool.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
                aborted = None
            usage = aborted.usage if aborted else Usage(0, 0)
            events.append(GenerateEvent(rid, "", (), "error", usage, f"engine error: {type(exc).__name__}: {exc}"))
        return events


def _settle(future: asyncio.Future, exc: Exception | None, result: object = None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)
