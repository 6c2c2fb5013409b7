"""AsyncEngine: runs EngineCore on a background thread and bridges its events to asyncio.

The engine loop owns the core; callers only post commands (add, abort) to its inbox. Torch
releases the GIL inside its kernels, so the event loop stays responsive while a step runs.
Validation and tokenization happen in the caller's `generate()` call, so a bad request raises
there and is never queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator

from loraplex.engine.api import (
    EngineStats,
    GenerateEvent,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    Usage,
)
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.sched.request import Request

log = logging.getLogger(__name__)


class AsyncEngine:
    """An `EngineClient` over one in-process EngineCore."""

    def __init__(self, core: EngineCore):
        self.core = core
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._removals: list[tuple[str, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(EngineCore(config))

    # --- EngineClient ------------------------------------------------------------------------

    def models(self) -> list[ModelInfo]:
        return [self.core.model_info()]

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return len(self.core.prepare(request).prompt_ids)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        if self._stopping:
            raise RuntimeError("engine is shut down")
        prepared = self.core.prepare(request)
        rid = request.request_id
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in flight", "request_id")
        queue: asyncio.Queue[GenerateEvent] = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), queue)
        self._post("add", prepared)
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

    async def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def add_adapter(self, adapter_id: str, path: str) -> None:
        """Validates and registers a PEFT directory (raises AdapterError; nothing changes then)."""
        self.core.add_adapter(adapter_id, path)

    async def remove_adapter(self, adapter_id: str) -> None:
        """Returns once the adapter is gone; new requests for it are refused at once, running
        ones finish first."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._post("remove", (adapter_id, loop, done))
        await done

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # --- the engine thread -----------------------------------------------------------------------

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
                assert isinstance(payload, Request)
                if payload.request_id in self._streams:
                    self.core.add(payload)
            elif kind == "remove":
                adapter_id, loop, done = payload
                try:
                    self.core.remove_adapter(adapter_id)
                    self._removals.append((adapter_id, loop, done))
                except Exception as exc:
                    loop.call_soon_threadsafe(_settle, done, exc)
            else:
                event = self.core.abort(str(payload))
                if event is not None:
                    self._deliver(event)
                else:
                    self._streams.pop(str(payload), None)
        self._settle_removals()

    def _settle_removals(self) -> None:
        lora = self.core.lora
        still = []
        for adapter_id, loop, done in self._removals:
            if lora is not None and adapter_id in lora:
                still.append((adapter_id, loop, done))
            else:
                loop.call_soon_threadsafe(_settle, done, None)
        self._removals = still

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._inbox and not self.core.has_work():
                    self._wake.wait()
                if self._stopping:
                    break
            self._drain_inbox()
            try:
                events = self.core.step()
            except Exception as exc:  # a failed step must not leave requests hanging
                log.exception("engine step failed")
                events = self._fail_all(exc)
            for event in events:
                self._deliver(event)
            if self._removals:
                self._settle_removals()
        for event in self._fail_all(RuntimeError("engine shut down")):
            self._deliver(event)

    def _fail_all(self, exc: Exception) -> list[GenerateEvent]:
        events = []
        for rid in list(self.core.requests):
            aborted = self.core.abort(rid)
            usage = aborted.usage if aborted else Usage(0, 0)
            events.append(GenerateEvent(rid, "", (), "error", usage, f"engine error: {exc}"))
        return events


def _settle(future: asyncio.Future, exc: Exception | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
