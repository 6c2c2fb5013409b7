"""One admitted request from engine submission to its usage event.

`GenerationRun` wraps the engine's event stream: it times the first token and the gaps between
tokens, counts what was generated, stops a generation that outlives the request timeout or whose
stream fails, and `close()` (idempotent, shielded from cancellation) does the ending exactly once
whatever happened: aborts the engine request unless it finished (a disconnected client, a
timeout, an engine failure), emits the usage event, records the metrics, and settles the budget
and rate-limit reservation with the tokens actually used in a background task, so that the
response does not wait for the round trip to Redis. The settlement is queued on the counters'
Redis connection when that task first runs (the next event-loop iteration), before this process
can read the client's next request, and that connection runs calls in order
(billing/redis_pipe.py): the client's next request to this instance sees the settlement. Other
instances see it once Redis has run it, a fraction of a millisecond after the response is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

import anyio

from loraplex.billing.usage import UsageEvent, UsageSink
from loraplex.engine.api import EngineClient, EngineError, GenerateEvent, GenerateRequest, ModelNotFoundError
from loraplex.platform.admission import Admission, Ticket
from loraplex.platform.auth import Principal
from loraplex.platform.background import Background
from loraplex.platform.errors import model_not_found
from loraplex.platform.metrics import Metrics
from loraplex.platform.routing import Target

log = logging.getLogger("loraplex.platform")


@dataclass(frozen=True)
class RunContext:
    """The services a run reports to."""

    engine: EngineClient
    admission: Admission
    metrics: Metrics
    usage: UsageSink
    background: Background
    request_timeout_s: float = 0.0  # 0: none


# How a stream that ran to its end ended, by the engine's finish reason.
_OUTCOMES = {"stop": "ok", "length": "ok", "abort": "aborted", "error": "error"}


class GenerationRun:
    def __init__(self, ctx: RunContext, request: GenerateRequest, principal: Principal, target: Target,
                 ticket: Ticket, prompt_tokens: int, endpoint: str, arrived: float, arrived_at: datetime):
        self.ctx, self.request, self.principal, self.target = ctx, request, principal, target
        self.ticket, self.prompt_tokens, self.endpoint, self.arrived = ticket, prompt_tokens, endpoint, arrived
        self.arrived_at = arrived_at
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.outcome: str | None = None  # ok, error, aborted, timeout; None while running or if the client left
        self.error: str | None = None
        self.ttft_s: float | None = None
        self._last_token_at = 0.0
        self._stream: AsyncIterator[GenerateEvent] | None = None
        self._closed = False

    def start(self) -> None:
        """Submits to the engine; raises before anything is sent to the client if it refuses."""
        try:
            self._stream = self.ctx.engine.generate(self.request)
        except ModelNotFoundError:
            raise model_not_found(self.target.requested) from None
        self.ctx.metrics.in_flight.labels(self.request.priority).inc()

    async def _next(self, stream: AsyncIterator[GenerateEvent]) -> GenerateEvent:
        """The next event, or TimeoutError once the request has run for request_timeout_s."""
        limit = self.ctx.request_timeout_s
        if not limit:
            return await anext(stream)
        async with asyncio.timeout(limit - (time.perf_counter() - self.arrived)):
            return await anext(stream)

    async def events(self) -> AsyncIterator[GenerateEvent]:
        assert self._stream is not None, "start() first"
        model = self.target.base_model
        while self.outcome is None:
            try:
                event = await self._next(self._stream)
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
                self.completion_tokens += n
            if event.finished:
                self.finish_reason = event.finish_reason
                self.outcome = _OUTCOMES.get(event.finish_reason, "error")
                self.error = event.error
                if self.outcome == "error":  # (the tenant gets a generic 503: the reason may name server paths)
                    log.error("generation %s failed in the engine: %s", self.request.request_id, self.error)
                if event.usage is not None:
                    self.prompt_tokens = event.usage.prompt_tokens
                    self.completion_tokens = event.usage.completion_tokens
                    self.cached_tokens = event.usage.cached_tokens
            yield event

    @property
    def status(self) -> str:
        return self.outcome or "client_disconnected"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._stream is None:
                return
            self.ctx.metrics.in_flight.labels(self.request.priority).dec()
            if self.finish_reason is None:
                await self._abort()
            else:
                with contextlib.suppress(RuntimeError):
                    await self._stream.aclose()
        self.ctx.background.spawn(self.ctx.admission.settle(self.ticket, self.prompt_tokens + self.completion_tokens),
                                  name=f"settle {self.request.request_id}")
        self._report()

    async def _abort(self) -> None:
        """Closing the stream aborts the request in AsyncEngine; abort() covers any other engine."""
        if self.outcome is None:
            self.ctx.metrics.disconnects.inc()
        with contextlib.suppress(RuntimeError):  # running in another task, whose cancellation closes it
            await self._stream.aclose()
        try:
            await self.ctx.engine.abort(self.request.request_id)
        except EngineError as exc:
            log.warning("abort of %s failed: %s", self.request.request_id, exc.message)

    def _report(self) -> None:
        latency = time.perf_counter() - self.arrived
        m, p, model = self.ctx.metrics, self.principal, self.target.base_model
        m.latency.labels(self.endpoint, self.status).observe(latency)
        m.tokens.labels(p.tenant, model, "prompt").inc(self.prompt_tokens)
        m.tokens.labels(p.tenant, model, "cached").inc(self.cached_tokens)
        m.tokens.labels(p.tenant, model, "completion").inc(self.completion_tokens)
        adapter = self.target.adapter.name if self.target.adapter else None
        event = UsageEvent(
            request_id=self.request.request_id, tenant_id=p.tenant_id, tenant=p.tenant, key_id=p.key_id,
            key_prefix=p.key_prefix, model=model, adapter=adapter, routed_from=self.target.routed_from,
            priority=self.request.priority,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens, ttft_s=self.ttft_s, latency_s=latency, status=self.status,
            finish_reason=self.finish_reason, endpoint=self.endpoint, created_at=self.arrived_at)
        try:
            self.ctx.usage.emit(event)
        except Exception:  # the sink must never fail a request that already ran
            log.exception("usage sink failed for %s", self.request.request_id)
