"""RayEngineClient: the gateway's EngineClient over a Serve deployment of engine replicas (replica.py).

- prepare() validates and tokenizes here, off the event loop, as the replicas' engines do (their frontends, rebuilt
  from what the replicas report: model source, limits, the smallest KV cache; the tokenizer read from the model's
  files; the adapters registered with this client), so generate() is the only call a request makes to a replica.
- generate() streams through the deployment handle (by value, over Serve's gRPC between a handle and a replica),
  tagged with a multiplexed model id: the request's adapter, or for a base-model request its model and tenant (a
  digest of its cache salt), so Serve's router keeps an adapter's requests on replicas that hold it and a tenant's
  shared prompts on one prefix cache.
- A request that fails before its first event (its replica died, or could not be reached) is sent again, at most
  RETRIES times, after a growing pause (RETRY_PAUSES_S: Serve's router may still pick a replica that just died
  until it hears of the death), and Serve routes it to a live replica; one cut off later ends with
  ReplicaUnavailableError, which the platform bills as what the client received.
- Adapters are registered with the client (validated on one replica); replicas read them on first use.
  Removal refuses new requests at once, then reaches every replica by broadcast.
- models(), stats() and replicas() read the last poll (a broadcast of status() every `poll_s`): the
  platform calls them synchronously. With no replica answering, models() is empty and /ready says no.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from loraplex.engine.api import (
    EngineError,
    EngineStats,
    EngineUnavailableError,
    GenerateEvent,
    GenerateRequest,
    ModelInfo,
    ModelNotFoundError,
    ReplicaInfo,
    Usage,
    add_stats,
    keep_maxima,
)
from loraplex.ray_serve.replica import AdapterSource, ReplicaStatus

log = logging.getLogger("loraplex.ray_serve")

# Resends of a request that failed before its first event, and the pause before each (8.5 s in all at most)
RETRY_PAUSES_S = (0.1, 0.4, 1.0, 2.0, 5.0)
RETRIES = len(RETRY_PAUSES_S)
STATUS_TIMEOUT_S = 10.0
# Threads that validate and tokenize requests (chat template, tokenizer, JSON-schema compile), as the engine's
# preparer: a hostile prompt takes one of them, never the event loop.
PREPARE_THREADS = 2


class ReplicaUnavailableError(EngineUnavailableError):
    code = "replica_unavailable"


def engine_error(exc: BaseException) -> BaseException:
    """The EngineError a replica raised, as the engine made it: Ray hands it over wrapped (a RayTaskError that
    is also an instance of the cause's class), whose attributes the platform's error answers would miss."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, EngineError) else exc


@dataclass
class _Flight:
    """A generation in flight: its stream (to cancel) and what the client has received."""

    stream: object
    prompt_tokens: int
    received: int = 0
    started: bool = False
    aborted: bool = False


def adapter_key(adapter_id: str) -> str:
    return f"adapter:{adapter_id}"


def affinity_key(request: GenerateRequest) -> str:
    """The multiplexed model id that routes a request: its adapter, else its model and tenant's cache salt."""
    if request.adapter is not None:
        return adapter_key(request.adapter)
    salt = hashlib.sha256((request.cache_salt or "").encode()).hexdigest()[:16]
    return f"base:{request.model}:{salt}"


def replica_failed(exc: Exception) -> ReplicaUnavailableError:
    return ReplicaUnavailableError(f"engine replica failed: {type(exc).__name__}: {exc}")


def _streaming(handle):
    """The handle that streams generations: by value over the replicas' gRPC server (as Serve's proxy does when
    throughput-optimized), not as Ray object refs, so a call costs less and each stream item about half (bench
    fleet's hop). `_by_reference` is a private option: a Ray without it streams by reference, slower but alike."""
    try:
        return handle.options(stream=True, _by_reference=False)
    except TypeError:
        log.warning("this Ray's handles have no _by_reference option: generations stream as object refs")
        return handle.options(stream=True)


class RayEngineClient:
    def __init__(self, handle, *, poll_s: float = 1.0, tagged: bool = True):
        """tagged=False sends no multiplexed ids: Serve then routes on load alone (a benchmark's baseline)."""
        self._handle = handle
        self.tagged = tagged
        self._stream = _streaming(handle)
        self.poll_s = poll_s
        self._replicas: list[ReplicaStatus] = []
        self._adapters: dict[str, AdapterSource] = {}
        self._in_flight: dict[str, _Flight] = {}
        self._poller: asyncio.Task | None = None
        self._frontends: dict[str, object] = {}  # model -> RequestFrontend (built from FrontendSpecs)
        self._frontends_of: tuple[ModelInfo, ...] = ()  # the models they were built for
        self._preparer = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="loraplex-prepare")

    # --- status ------------------------------------------------------------------------------------

    def connect(self) -> None:
        """Reads the replicas' status once (blocking: at start, before the event loop runs)."""
        self._replicas = self._handle.broadcast("status").results(timeout_s=STATUS_TIMEOUT_S)
        if not self._replicas:
            raise RuntimeError("the Serve deployment has no replica")
        self._build_frontends(self._handle.broadcast("frontends").results(timeout_s=STATUS_TIMEOUT_S))

    async def poll(self) -> None:
        """Reads every live replica's status; replicas that fail to answer are left out until they do. Models
        other than those the frontends were built for (a gateway deployed other options) rebuild them."""
        answers = await self._handle.broadcast("status").results_async(timeout_s=STATUS_TIMEOUT_S,
                                                                       return_exceptions=True)
        self._replicas = [a for a in answers if isinstance(a, ReplicaStatus)]
        if self._replicas and set(self._replicas[0].models) != set(self._frontends_of):
            specs = await self._handle.broadcast("frontends").results_async(timeout_s=STATUS_TIMEOUT_S,
                                                                            return_exceptions=True)
            await asyncio.get_running_loop().run_in_executor(
                self._preparer, self._build_frontends, [s for s in specs if isinstance(s, list)])

    def _build_frontends(self, answers: list[list]) -> None:
        """Each model's frontend from the replicas' FrontendSpecs (replica.frontends): one replica's limits (they
        run the same options), the smallest KV cache of all, so nothing a replica would refuse for its size passes
        here; adapters as registered with this client. Blocking: reads each model's tokenizer."""
        specs: dict[str, object] = {}
        for spec in (s for answer in answers for s in answer):
            if spec.name not in specs or spec.num_kv_blocks < specs[spec.name].num_kv_blocks:
                specs[spec.name] = spec
        if not specs:  # (no replica answered: the frontends stand)
            return
        frontends = {name: spec.build(functools.partial(self._adapter_available, name))
                     for name, spec in specs.items()}
        for frontend in frontends.values():
            frontend.guide_vocabulary()  # now, not on the first schema request's preparer thread
        self._frontends, self._frontends_of = frontends, tuple(f.info() for f in frontends.values())

    async def start(self) -> None:
        async def loop() -> None:
            while True:
                try:
                    await self.poll()
                except Exception as exc:  # Serve busy or restarting: the last status stands
                    log.warning("replica status poll failed: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(self.poll_s)

        self._poller = asyncio.get_running_loop().create_task(loop(), name="ray-serve-status")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        self._preparer.shutdown(wait=False, cancel_futures=True)

    def models(self) -> list[ModelInfo]:
        return list(self._replicas[0].models) if self._replicas else []

    def stats(self) -> EngineStats:
        """Totals over the replicas (their counters since each began)."""
        per_replica = [replica.stats.as_dict() for replica in self._replicas]
        total: dict = {}
        for stats in per_replica:
            add_stats(total, stats)
        keep_maxima(total, per_replica)
        return EngineStats.from_dict(total)

    def compute_path(self) -> None:
        return None  # (the replicas run the engine, each on its own machine)

    def replicas(self) -> list[ReplicaInfo]:
        """The replicas, as the last poll found them."""
        return [ReplicaInfo(r.replica, tuple(m.name for m in r.models), r.adapters,
                            r.stats.requests.running, r.stats.requests.waiting,
                            r.requests) for r in self._replicas]

    # --- generation ----------------------------------------------------------------------------------

    def _source(self, request: GenerateRequest) -> AdapterSource | None:
        """Where replicas read the request's adapter; ModelNotFoundError for one not registered (or removed)."""
        if request.adapter is None:
            return None
        source = self._adapters.get(request.adapter)
        if source is None:
            raise ModelNotFoundError(f"adapter {request.adapter!r} not found", "adapter")
        return source

    def _adapter_available(self, model: str, adapter_id: str) -> bool:
        return self.has_adapter(adapter_id, model)

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        """Validated and tokenized here, on a preparer thread, raising the errors the engine would; no replica
        is called."""
        frontend = self._frontends.get(request.model)
        if frontend is None:
            raise ModelNotFoundError(f"model {request.model!r} not found", "model")
        return await asyncio.get_running_loop().run_in_executor(self._preparer, frontend.tokenized, request)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """Raises ModelNotFoundError now, for an adapter not registered; else the stream of events."""
        return self._events(request, self._source(request))

    async def _events(self, request: GenerateRequest, source: AdapterSource | None) -> AsyncIterator[GenerateEvent]:
        handle = self._stream.options(multiplexed_model_id=affinity_key(request)) if self.tagged else self._stream
        flight = _Flight(None, len(request.prompt_token_ids or ()))
        self._in_flight[request.request_id] = flight
        try:
            for attempt in range(RETRIES + 1):
                flight.stream = handle.generate.remote(request, source)
                try:
                    async for events in flight.stream:  # (lists: replica.coalesced)
                        flight.started = True
                        for event in events:
                            flight.received += len(event.token_ids)
                            yield event
                            if event.finished:
                                return
                    raise ReplicaUnavailableError("the replica's stream ended before the request finished")
                except EngineError as exc:
                    raise engine_error(exc) from None
                except (asyncio.CancelledError, GeneratorExit):
                    raise
                except Exception as exc:
                    if flight.started or flight.aborted or attempt == RETRIES:
                        raise replica_failed(exc) from exc
                    log.warning("request %s failed before its first token (%s); sending it again",
                                request.request_id, type(exc).__name__)
                    await asyncio.sleep(RETRY_PAUSES_S[attempt])
                    if flight.aborted:  # (while it paused)
                        raise replica_failed(exc) from exc
        finally:
            self._in_flight.pop(request.request_id, None)

    async def abort(self, request_id: str) -> Usage | None:
        """Cancels the request's stream (its replica aborts it); returns what this client received."""
        flight = self._in_flight.pop(request_id, None)
        if flight is None:
            return None
        flight.aborted = True
        if flight.stream is not None:
            flight.stream.cancel()
        return Usage(flight.prompt_tokens, flight.received)

    # --- adapters ----------------------------------------------------------------------------------

    def add_adapter(self, adapter_id: str, path: str, base_model: str | None = None) -> None:
        """Validates by registering on one replica (the one its requests will prefer); blocking, so called off
        the event loop, as the platform does."""
        source = AdapterSource(adapter_id, path, base_model or self.models()[0].name)
        try:
            handle = self._handle.options(multiplexed_model_id=adapter_key(adapter_id)) if self.tagged else self._handle
            handle.register.remote(source).result()
        except EngineError as exc:
            raise engine_error(exc) from None
        self._adapters[adapter_id] = source

    def has_adapter(self, adapter_id: str, base_model: str | None = None) -> bool:
        source = self._adapters.get(adapter_id)
        return source is not None and (base_model is None or source.base_model == base_model)

    async def remove_adapter(self, adapter_id: str, base_model: str | None = None) -> None:
        """Refuses new requests for it now; returns once every replica has dropped it."""
        if self._adapters.pop(adapter_id, None) is None:
            raise ModelNotFoundError(f"adapter {adapter_id!r} not found", "adapter")
        await self._handle.broadcast("remove_adapter", adapter_id).results_async()
