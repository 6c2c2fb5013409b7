"""EngineReplica: the Serve deployment class. Each replica runs one engine, built in the replica by the factory
it is given, and serves the calls RayEngineClient makes through the deployment's handle.

- Affinity: each generation is tagged with a multiplexed model id (its adapter, or its base model and tenant),
  and the replica declares the ids it holds through `serve.multiplexed`, so Serve's router sends later requests
  with the same id to a replica that has it (the adapter in a slot, the tenant's prefixes in its cache).
- Adapters are registered on first use from the shared adapter store: each request for an adapter carries
  where its files are, and a replica that does not have it yet reads it then (off the event loop).
- Events travel in lists: each item of the stream carries every event that arrived while the one before was
  being sent (`coalesced`), so a stream item's fixed cost is paid per batch, not per token, once the engine
  outpaces the stream; the first event goes alone, at once.
- `status()` answers the client's broadcast poll: the engine's stats and models, the adapters registered here.
- `frontends()` tells the gateway how the engine validates and tokenizes (model source, limits, KV capacity), so
  requests are prepared there and a generation is the one call a request makes to a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ray import serve

from loraplex.engine.api import EngineClient, EngineStats, GenerateEvent, GenerateRequest, ModelInfo

AFFINITY_KEYS_PER_REPLICA = 64  # multiplexed ids a replica reports as held (least recently used dropped first)
EVENTS_PER_ITEM = 256  # at most, in one stream item (a gRPC message holds 4 MiB: events with logprobs stay below)


async def coalesced(events: AsyncIterator[GenerateEvent]) -> AsyncIterator[list[GenerateEvent]]:
    """`events` regrouped: each list holds every event that arrived since the last list was taken (at least one).
    A background task reads `events`; an error there is raised here after the events before it; closing this
    generator (a cancelled stream) cancels the reading, which aborts the request in the engine."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump() -> None:
        try:
            async for event in events:
                queue.put_nowait(event)
        except Exception as exc:  # handed to the reader, after the events before it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(end)

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty() and len(batch) < EVENTS_PER_ITEM:
                batch.append(queue.get_nowait())
            done = batch[-1] is end
            failed = [e for e in batch if isinstance(e, Exception)]
            batch = [e for e in batch if e is not end and not isinstance(e, Exception)]
            if batch:
                yield batch
            if failed:
                raise failed[0]
            if done:
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass(frozen=True)
class AdapterSource:
    """Where a replica reads an adapter it has not registered yet."""

    adapter_id: str
    path: str
    base_model: str


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as its status() call found it."""

    replica: str
    models: tuple[ModelInfo, ...]
    stats: EngineStats
    adapters: tuple[str, ...]  # registered on this replica
    requests: int  # generations it has started since it began


class EngineReplica:
    def __init__(self, engine_factory: Callable[[], EngineClient]):
        self.engine = engine_factory()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._adapters: dict[str, str] = {}  # adapter id -> base model, registered in this engine
        self._registering: dict[str, asyncio.Lock] = {}
        self._requests = 0

    @serve.multiplexed(max_num_models_per_replica=AFFINITY_KEYS_PER_REPLICA)
    async def _hold(self, key: str) -> str:
        """Declares `key` held by this replica (Serve's router prefers replicas that hold a request's id)."""
        return key

    async def _hold_request_key(self) -> None:
        key = serve.get_multiplexed_model_id()
        if key:
            await self._hold(key)

    async def generate(self, request: GenerateRequest,
                       adapter: AdapterSource | None) -> AsyncIterator[list[GenerateEvent]]:
        """The request's events, in lists (`coalesced`); cancelling the stream (the client's abort, a lost gateway)
        aborts it here. The gateway prepared it (tokens, no prompt): the engine validates it again, at once."""
        await self._take(adapter)
        if request.sampling.json_schema is not None:  # its grammar compiled on a preparer thread, not this loop
            request = await self.engine.prepare(request)
        self._requests += 1
        async for events in coalesced(self.engine.generate(request)):
            yield events

    def frontends(self) -> list:
        """The engine's FrontendSpecs (engine/frontend.py): the gateway validates and tokenizes as this engine does."""
        return self.engine.frontend_specs()

    async def _take(self, adapter: AdapterSource | None) -> None:
        """Registers the request's adapter if it has one, else declares its multiplexed id held."""
        if adapter is not None:
            await self.register(adapter)
        else:
            await self._hold_request_key()

    async def register(self, adapter: AdapterSource) -> None:
        """Validates and registers the adapter here unless it already is (raises EngineError); declares the
        call's multiplexed id held."""
        await self._hold_request_key()
        if adapter.adapter_id in self._adapters:
            return
        lock = self._registering.setdefault(adapter.adapter_id, asyncio.Lock())
        async with lock:
            if adapter.adapter_id not in self._adapters:
                await asyncio.to_thread(self.engine.add_adapter, adapter.adapter_id, adapter.path, adapter.base_model)
                self._adapters[adapter.adapter_id] = adapter.base_model
        self._registering.pop(adapter.adapter_id, None)

    async def remove_adapter(self, adapter_id: str) -> bool:
        """Drops the adapter once its running requests here are done; False when it was not registered here."""
        base_model = self._adapters.pop(adapter_id, None)
        if base_model is None:
            return False
        await self.engine.remove_adapter(adapter_id, base_model)
        return True

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(self.replica, tuple(self.engine.models()), self.engine.stats(),
                             tuple(sorted(self._adapters)), self._requests)
