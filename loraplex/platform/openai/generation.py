"""One admitted request from engine submission to its usage event: `GenerationRun` ends every request exactly once.

- It wraps the engine's event streams, one per choice (`n` of them; the engine computes their shared prompt once, and
  the request is billed for it once), times the first token and the gaps between tokens, and counts what was
  generated.
- It stops a generation that outlives the request timeout or whose stream fails (one failing choice fails the
  request).
- `close()` (idempotent, shielded from cancellation) does the ending whatever happened: aborts the engine requests
  that did not finish (a disconnected client, a timeout, an engine failure), emits one usage event, records the
  metrics, and settles the budget and rate-limit reservation with the tokens actually used.
- The settlement runs in a background task, so the response does not wait for the round trip to Redis. It is queued
  on the counters' Redis connection when that task first runs (the next event-loop iteration), before this process
  can read the client's next request, and that connection runs calls in order (billing/redis_pipe.py): the client's
  next request to this instance sees the settlement. Other instances see it once Redis has run it, a fraction of a
  millisecond after the response is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from datetime import datetime

import anyio

from loraplex.billing.usage import UsageEvent
from loraplex.engine.api import EngineError, GenerateEvent, GenerateRequest, ModelNotFoundError
from loraplex.platform.admission import Ticket
from loraplex.platform.auth import Principal
from loraplex.platform.errors import model_not_found
from loraplex.platform.routing.resolution import Target
from loraplex.platform.state import RunContext

log = logging.getLogger("loraplex.platform")


# How a stream that ran to its end ended, by the engine's finish reason.
_OUTCOMES = {"stop": "ok", "length": "ok", "abort": "aborted", "error": "error"}


def choices_of(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The engine requests of n choices: ids of their own, and a seeded request's choice i seeded
    with seed + i (wrapped to 64 bits), so that its choices differ and each is reproducible. Each
    shares the request's prompt as it is: one from EngineClient.prepare carries its token ids, so
    no choice is tokenized again."""
    if n == 1:
        return [request]
    seed = request.sampling.seed

    def sampling(i: int):
        if seed is None or i == 0:
            return request.sampling
        return dataclasses.replace(request.sampling, seed=(seed + i) % 2**64)

    return [dataclasses.replace(request, request_id=f"{request.request_id}-{i}", sampling=sampling(i))
            for i in range(n)]


class _Streams:
    """The choices' event streams as one: the next event of whichever choice has one first (a
    choice's own events stay in order). One stream is read directly, with no task per event."""

    def __init__(self, streams: list[AsyncIterator[GenerateEvent]]):
        self.streams = streams
        self._pending: dict[asyncio.Future, int] = {}  # a stream's next event being awaited -> its index
        self._ready: deque[tuple[int, GenerateEvent]] = deque()
        self._ended: set[int] = set()

    async def next(self) -> tuple[int, GenerateEvent]:
        if len(self.streams) == 1:
            return 0, await anext(self.streams[0])
        while not self._ready:
            armed = set(self._pending.values())
            for i, stream in enumerate(self.streams):
                if i not in armed and i not in self._ended:
                    self._pending[asyncio.ensure_future(anext(stream))] = i
            if not self._pending:
                raise StopAsyncIteration
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=self._pending.__getitem__):
                i = self._pending.pop(task)
                event = task.result()
                if event.finished:
                    self._ended.add(i)
                self._ready.append((i, event))
        return self._ready.popleft()

    async def close(self) -> None:
        """Stops the reads in flight (a stream's own `finally` aborts its request) and closes the streams."""
        for task in self._pending:
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending.clear()
        for stream in self.streams:
            with contextlib.suppress(RuntimeError):  # running in another task, whose cancellation closes it
                await stream.aclose()


class GenerationRun:
    def __init__(self, ctx: RunContext, request: GenerateRequest, principal: Principal, target: Target,
                 ticket: Ticket, prompt_tokens: int, endpoint: str, arrived: float, arrived_at: datetime,
                 n: int = 1):
        self.ctx, self.request, self.principal, self.target = ctx, request, principal, target
        self.ticket, self.prompt_tokens, self.endpoint, self.arrived = ticket, prompt_tokens, endpoint, arrived
        self.arrived_at = arrived_at
        self.choices = choices_of(request, n)
        self.generated = [0] * n  # completion tokens per choice
        self.finish_reasons: list[str | None] = [None] * n
        self._cached: list[int] = []  # prompt tokens served from the cache, per finished choice
        self.outcome: str | None = None  # ok, error, aborted, timeout; None while running or if the client left
        self.error: str | None = None
        self.ttft_s: float | None = None
        self._last_token_at = 0.0
        self._streams: _Streams | None = None
        self._submitted: list[str] = []  # engine request ids, as submitted
        self._closed = False

    @property
    def completion_tokens(self) -> int:
        return sum(self.generated)

    @property
    def cached_tokens(self) -> int:
        """The prompt's hits on earlier requests' blocks: the least any choice had, since the others'
        include their sibling's blocks, and the prompt is billed once."""
        return min(self._cached, default=0)

    @property
    def finish_reason(self) -> str | None:
        """The first choice's (the usage event's record of how the request ended)."""
        return self.finish_reasons[0]

    def start(self) -> None:
        """Submits every choice to the engine; raises before anything is sent to the client if it
        refuses one (then `discard` aborts those already submitted and releases the reservation)."""
        streams = []
        try:
            for choice in self.choices:
                streams.append(self.ctx.engine.generate(choice))
                self._submitted.append(choice.request_id)
        except ModelNotFoundError:
            raise model_not_found(self.target.requested) from None
        self._streams = _Streams(streams)
        self.ctx.metrics.in_flight.labels(self.request.priority).inc()

    async def discard(self) -> None:
        """After a refused start(): aborts the choices submitted before the refusal and releases the
        reservation; nothing was generated for the client, so nothing is reported."""
        await self._abort_engine(self._submitted)
        await self.ctx.admission.settle(self.ticket, 0)

    async def _next(self) -> tuple[int, GenerateEvent]:
        """The next event, or TimeoutError once the request has run for request_timeout_s."""
        limit = self.ctx.request_timeout_s
        if not limit:
            return await self._streams.next()
        async with asyncio.timeout(limit - (time.perf_counter() - self.arrived)):
            return await self._streams.next()

    async def events(self) -> AsyncIterator[tuple[int, GenerateEvent]]:
        """(choice index, event) as the choices produce them, until all finished or one failed."""
        assert self._streams is not None, "start() first"
        model = self.target.base_model
        while self.outcome is None:
            try:
                i, event = await self._next()
            except StopAsyncIteration:
                self.outcome = "error"  # the engine's stream ended without a last event
                break
            except TimeoutError:
                self.outcome = "timeout"
                self.ctx.metrics.timeouts.inc()
                break
            except Exception as exc:  # the engine failed mid-stream: charge what it generated
                self.outcome, self.error = "error", f"{type(exc).__name__}: {exc}"
                log.error("generation %s failed: %s", self.request.request_id, self.error)
                break
            n = len(event.token_ids)
            if n:
                now = time.perf_counter()
                if self.ttft_s is None:
                    self.ttft_s = now - self.arrived
                    self.ctx.metrics.ttft.labels(model).observe(self.ttft_s)
                else:
                    gap = (now - self._last_token_at) / n
                    for _ in range(n):
                        self.ctx.metrics.itl.labels(model).observe(gap)
                self._last_token_at = now
                self.generated[i] += n
            if event.finished:
                self._finished(i, event)
            yield i, event

    def _finished(self, i: int, event: GenerateEvent) -> None:
        self.finish_reasons[i] = event.finish_reason
        if event.usage is not None:
            self.prompt_tokens = event.usage.prompt_tokens
            self.generated[i] = event.usage.completion_tokens
            self._cached.append(event.usage.cached_tokens)
        outcome = _OUTCOMES.get(event.finish_reason, "error")
        if outcome != "ok":
            self.outcome, self.error = outcome, event.error
            if outcome == "error":  # (the tenant gets a generic 503: the reason may name server paths)
                log.error("generation %s failed in the engine: %s", event.request_id, self.error)
        elif None not in self.finish_reasons:
            self.outcome = "ok"

    @staticmethod
    def ended_well(event: GenerateEvent) -> bool:
        """A choice's last event that ends it as asked (stop or length), not by abort or error."""
        return event.finished and _OUTCOMES.get(event.finish_reason) == "ok"

    @property
    def status(self) -> str:
        return self.outcome or "client_disconnected"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._streams is None:
                return
            self.ctx.metrics.in_flight.labels(self.request.priority).dec()
            if self.outcome is None:
                self.ctx.metrics.disconnects.inc()
            await self._streams.close()
            await self._abort_engine([c.request_id for c, reason in zip(self.choices, self.finish_reasons, strict=True)
                                      if reason is None])
        self.ctx.background.spawn(self.ctx.admission.settle(self.ticket, self.prompt_tokens + self.completion_tokens),
                                  name=f"settle {self.request.request_id}")
        self._report()

    async def _abort_engine(self, request_ids: list[str]) -> None:
        """Closing a stream aborts its request in AsyncEngine; abort() covers any other engine."""
        for rid in request_ids:
            try:
                await self.ctx.engine.abort(rid)
            except EngineError as exc:
                log.warning("abort of %s failed: %s", rid, exc.message)

    def _report(self) -> None:
        latency = time.perf_counter() - self.arrived
        m, p, model = self.ctx.metrics, self.principal, self.target.base_model
        m.latency.labels(self.endpoint, self.status).observe(latency)
        m.tokens.labels(p.tenant, model, "prompt").inc(self.prompt_tokens)
        m.tokens.labels(p.tenant, model, "cached").inc(self.cached_tokens)
        m.tokens.labels(p.tenant, model, "completion").inc(self.completion_tokens)
        adapter = self.target.adapter.name if self.target.adapter else None
        if adapter is not None:  # (a registered adapter: the request resolved to its row)
            m.adapter_tokens.add(p.tenant, adapter, self.prompt_tokens, self.completion_tokens)
        event = UsageEvent(
            request_id=self.request.request_id, tenant_id=p.tenant_id, tenant=p.tenant, key_id=p.key_id,
            key_prefix=p.key_prefix, model=model, adapter=adapter, routed_from=self.target.routed_from,
            route_score=self.target.complexity, priority=self.request.priority,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens, ttft_s=self.ttft_s, latency_s=latency, status=self.status,
            finish_reason=self.finish_reason, endpoint=self.endpoint, created_at=self.arrived_at)
        try:
            self.ctx.usage.emit(event)
        except Exception:  # the sink must never fail a request that already ran
            log.exception("usage sink failed for %s", self.request.request_id)
