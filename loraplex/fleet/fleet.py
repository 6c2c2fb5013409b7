"""EngineFleet: one EngineClient over several engine workers, keeping each adapter on few of them.

A worker's device holds a handful of adapter slots; spreading one adapter's requests over every
worker would load it into all of them and evict the others, so each request goes where
`placement.pick` says (by default: within a load bound, a worker where its adapter is running, else
the adapter's rendezvous-first worker with a slot free, else its first).

- Adapters are registered with the fleet (validated on the adapter's preferred worker, which
  answers for the whole fleet) and with a worker only when it first gets one of their requests.
- The fleet polls every worker's health (models, stats, instance) every `poll_s`. A worker that
  does not answer gets no new requests until it does; one that answers as a new instance (it
  restarted) has forgotten its adapters, and is given them again on demand.
- A request whose worker cannot be reached before its first event goes to the next worker; one cut
  off later, or whose stream stays silent past the worker's heartbeats, fails with
  WorkerUnavailableError (the platform charges its prompt and what it received).
- models() and stats() read the last poll: the platform calls them synchronously.

What it does not do: move a running request between workers, or share one worker's prefix cache
with another; several serving instances over one fleet each count only their own requests' load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import anyio

from loraplex.engine.api import (
    ENGINE_COUNTERS,
    EngineError,
    EngineStats,
    GenerateEvent,
    GenerateRequest,
    ModelInfo,
    ModelNotFoundError,
    Usage,
    WorkerStatus,
    add_stats,
)
from loraplex.fleet import placement, wire
from loraplex.fleet.remote import RemoteWorker, WorkerUnavailableError

log = logging.getLogger("loraplex.fleet")

AdapterKey = tuple[str, str]  # (base model, adapter id)


class EngineFleet:
    def __init__(self, workers: Sequence[RemoteWorker], *, policy: placement.Policy = "affinity",
                 slack: float = placement.DEFAULT_SLACK, poll_s: float = 1.0):
        if not workers:
            raise ValueError("a fleet needs at least one worker")
        if len({w.url for w in workers}) != len(workers):
            raise ValueError("a worker is named twice")
        if policy not in placement.POLICIES:
            raise ValueError(f"unknown placement policy {policy!r} (one of {', '.join(placement.POLICIES)})")
        self.workers = {w.url: w for w in workers}
        self.policy, self.slack, self.poll_s = policy, slack, poll_s
        self.health: dict[str, wire.Health | None] = dict.fromkeys(self.workers)  # None: not answering
        self._last: dict[str, wire.Health] = {}  # each worker's last answer, kept while it does not answer
        self._retired: dict = {}  # counters of workers' earlier instances (a restart starts them at 0)
        self.load: Counter[str] = Counter()  # requests in flight per worker, through this fleet
        self._running: Counter[tuple[str, str]] = Counter()  # (worker, placement key) -> requests in flight
        self._adapters_running: Counter[str] = Counter()  # worker -> distinct adapters with requests in flight
        self.routed: Counter[str] = Counter()  # requests sent per worker since start
        self._where: dict[str, str] = {}  # request id -> its worker
        self._adapters: dict[AdapterKey, str] = {}  # registered with the fleet -> the directory
        self._registered: dict[str, set[AdapterKey]] = {url: set() for url in self.workers}
        self._registering: dict[str, asyncio.Lock] = {}
        self._monitor: asyncio.Task | None = None
        self._closed = False

    # --- health ---------------------------------------------------------------------------------

    def connect(self) -> None:
        """Polls every worker once, blocking (before the event loop runs); raises unless one answers."""
        errors = []
        for url, worker in self.workers.items():
            try:
                self._saw(url, worker.health_now())
            except EngineError as exc:  # unreachable, or refusing us (a wrong token)
                self._lost(url, exc)
                errors.append(exc.message)
        if not any(self.health.values()):
            raise WorkerUnavailableError("no worker answers: " + "; ".join(errors))

    async def start(self) -> None:
        """Starts polling the workers (the serving app's startup)."""
        if self._monitor is None:
            await self.poll()
            self._monitor = asyncio.create_task(self._watch(), name="loraplex-fleet-health")

    async def close(self) -> None:
        self._closed = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        for worker in self.workers.values():
            await worker.aclose()

    async def poll(self) -> None:
        """Asks every worker for its health at once."""
        async def one(url: str, worker: RemoteWorker) -> None:
            try:
                self._saw(url, await worker.health())
            except EngineError as exc:
                self._lost(url, exc)
        await asyncio.gather(*(one(url, w) for url, w in self.workers.items()))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.poll()

    def _saw(self, url: str, health: wire.Health) -> None:
        before = self._last.get(url)
        if before is not None and before.instance != health.instance:
            log.warning("worker %s is a new instance: its adapters will be registered again", url)
            self._registered[url].clear()
            add_stats(self._retired, _counters(before.stats))
        self.health[url] = self._last[url] = health

    def _lost(self, url: str, exc: EngineError) -> None:
        if self.health[url] is not None:
            log.warning("worker %s lost: %s", url, exc.message)
        self.health[url] = None

    def registered(self, url: str) -> set[AdapterKey]:
        """The adapters the worker holds for this fleet (registered through it, since its last restart)."""
        return set(self._registered[url])

    # --- placement ------------------------------------------------------------------------------

    def _serving(self, model: str) -> list[str]:
        return [url for url, h in self.health.items() if h is not None and any(m.name == model for m in h.models)]

    def _default_model(self) -> str:
        return next((h.models[0].name for h in self.health.values() if h is not None and h.models), "")

    def _pick(self, request: GenerateRequest, exclude: Sequence[str] = ()) -> str:
        urls = [u for u in self._serving(request.model) if u not in exclude]
        if not urls:
            if exclude:
                raise WorkerUnavailableError(f"no worker serving {request.model!r} could take the request")
            raise ModelNotFoundError(f"model {request.model!r} not found", "model")
        key = placement.placement_key(request.model, request.adapter, request.cache_salt)
        warm = [u for u in urls if self._running[(u, key)]]
        full = [] if request.adapter is None else [u for u in urls if self._slots_taken(u)]
        return placement.pick(key, urls, self.load, policy=self.policy, slack=self.slack, warm=warm, full=full)

    def _slots_taken(self, url: str) -> bool:
        """Every adapter slot of the worker holds an adapter with requests running (as far as this
        instance knows): a request for another adapter would wait there for one to free."""
        health = self.health[url]
        slots = health.stats.adapter_slots if health is not None else 0
        return bool(slots) and self._adapters_running[url] >= slots

    async def _ensure_adapter(self, url: str, request: GenerateRequest) -> None:
        """Registers the request's adapter on the worker, if the fleet has it and the worker does not."""
        key = (request.model, request.adapter or "")
        if request.adapter is None or key not in self._adapters or key in self._registered[url]:
            return
        async with self._registering.setdefault(url, asyncio.Lock()):
            if key in self._registered[url] or key not in self._adapters:
                return
            await anyio.to_thread.run_sync(self.workers[url].add_adapter, request.adapter, self._adapters[key],
                                           request.model)
            if key not in self._adapters:  # removed from the fleet meanwhile: take it back off the worker
                await self.workers[url].remove_adapter(request.adapter, request.model)
                raise ModelNotFoundError(f"adapter {request.adapter!r} not found", "model")
            self._registered[url].add(key)

    # --- EngineClient ---------------------------------------------------------------------------

    def models(self) -> list[ModelInfo]:
        seen: dict[str, ModelInfo] = {}
        for h in self.health.values():
            for m in h.models if h is not None else ():
                seen.setdefault(m.name, m)
        return list(seen.values())

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        """On the worker the request would go to now (its model's tokenizer is the same on any other)."""
        url = self._pick(request)
        await self._ensure_adapter(url, request)
        return await self.workers[url].prepare(request)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        tried: list[str] = []
        key = placement.placement_key(request.model, request.adapter, request.cache_salt)
        while True:
            url = self._pick(request, tried)
            started = finished = False
            self.load[url] += 1
            self._running[(url, key)] += 1
            if request.adapter is not None and self._running[(url, key)] == 1:
                self._adapters_running[url] += 1
            self.routed[url] += 1
            self._where[request.request_id] = url
            try:
                await self._ensure_adapter(url, request)
                async for event in self.workers[url].generate(request):
                    started, finished = True, event.finished
                    yield event
                return
            except WorkerUnavailableError as exc:
                self._lost(url, exc)
                if started:
                    raise
                tried.append(url)  # nothing reached the caller: the next worker takes it
            finally:
                self.load[url] -= 1
                self._running[(url, key)] -= 1
                if not self._running[(url, key)]:
                    del self._running[(url, key)]
                    if request.adapter is not None:
                        self._adapters_running[url] -= 1
                self._where.pop(request.request_id, None)
                # the caller left: free its KV (unless the worker is lost, or the fleet closed under the stream)
                if started and not finished and self.health[url] is not None and not self._closed:
                    with contextlib.suppress(WorkerUnavailableError):
                        await self.workers[url].abort(request.request_id)

    async def abort(self, request_id: str) -> Usage | None:
        url = self._where.get(request_id)
        return None if url is None else await self.workers[url].abort(request_id)

    def add_adapter(self, adapter_id: str, path: str, base_model: str | None = None) -> None:
        """Blocking: the adapter's preferred worker validates it (raising EngineError as an engine
        would) and keeps it registered; the others register it on their first request for it."""
        model = base_model or self._default_model()
        probe, tried = GenerateRequest("", model, prompt="", adapter=adapter_id), []
        while True:
            url = self._pick(probe, tried)
            try:
                self.workers[url].add_adapter(adapter_id, path, model)
                break
            except WorkerUnavailableError as exc:  # (lost since the last poll) the next worker validates it
                self._lost(url, exc)
                tried.append(url)
        self._registered[url].add((model, adapter_id))
        self._adapters[(model, adapter_id)] = path

    def has_adapter(self, adapter_id: str, base_model: str | None = None) -> bool:
        return (base_model or self._default_model(), adapter_id) in self._adapters

    async def remove_adapter(self, adapter_id: str, base_model: str | None = None) -> None:
        """Refuses new requests for it at once; returns when every worker holding it has dropped it
        (its running requests finish first). A worker not answering forgets it when it restarts."""
        key = (base_model or self._default_model(), adapter_id)
        self._adapters.pop(key, None)

        async def one(url: str) -> None:
            with contextlib.suppress(WorkerUnavailableError):
                await self.workers[url].remove_adapter(adapter_id, key[0])
            self._registered[url].discard(key)
        await asyncio.gather(*(one(url) for url, keys in self._registered.items() if key in keys))

    def worker_status(self) -> list[WorkerStatus]:
        status = []
        for url in self.workers:
            h = self.health[url]
            status.append(WorkerStatus(
                url=url, up=h is not None, models=tuple(m.name for m in h.models) if h else (),
                in_flight=self.load[url], requests=self.routed[url], adapters=len(self._registered[url]),
                running=h.stats.running if h else 0, waiting=h.stats.waiting if h else 0))
        return status

    def stats(self) -> EngineStats:
        """What holds now over the workers answering; totals since start over every worker that ever
        answered (a lost or restarted worker's counters stay counted, so they never go back)."""
        total: dict = {"running": 0, "waiting": 0, "kv_blocks_total": 0, "kv_blocks_used": 0, "kv_blocks_free": 0}
        for url, h in self._last.items():
            values = vars(h.stats) if self.health[url] is not None else _counters(h.stats)
            add_stats(total, values)
        add_stats(total, self._retired)
        return EngineStats(**total)


def _counters(stats: EngineStats) -> dict:
    return {k: getattr(stats, k) for k in ENGINE_COUNTERS}
