"""The usage hook: one event per finished request, handed to a sink.

The platform calls `UsageSink.emit` once per request, whatever its outcome; the ledger writer
(ledger.py: batched inserts keyed by request_id, a local spool while the database is down)
implements the same protocol. `emit` must not block: it runs on the request's event loop.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

log = logging.getLogger("loraplex.usage")


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class UsageEvent:
    """What one request consumed. `request_id` is the idempotency key of the ledger row;
    `created_at` is the request's arrival, which decides its period and its price."""

    request_id: str
    tenant_id: int
    tenant: str
    key_id: int
    key_prefix: str  # the display prefix, never the secret
    model: str
    adapter: str | None
    priority: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float
    status: str  # "ok", "error", "aborted", "timeout", "client_disconnected"
    finish_reason: str | None
    endpoint: str = "chat.completions"
    created_at: datetime = field(default_factory=utcnow)
    routed_from: str | None = None  # the `model` asked for, when a router picked another
    route_score: float | None = None  # the router's score for the request (0-1), when it picked

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["created_at"] = self.created_at.astimezone(UTC).isoformat()
        return data

    @classmethod
    def from_json(cls, data: dict) -> UsageEvent:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["created_at"] = datetime.fromisoformat(values["created_at"])
        return cls(**values)


class UsageSink(Protocol):
    def emit(self, event: UsageEvent) -> None: ...


class LogUsageSink:
    """One debug line per request."""

    def emit(self, event: UsageEvent) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("usage %s tenant=%s key=%s model=%s adapter=%s prompt=%d cached=%d completion=%d status=%s",
                      event.request_id, event.tenant, event.key_prefix, event.model, event.adapter,
                      event.prompt_tokens, event.cached_tokens, event.completion_tokens, event.status)


class MemoryUsageSink:
    """Keeps every event in a list (tests, benchmarks)."""

    def __init__(self) -> None:
        self.events: list[UsageEvent] = []

    def emit(self, event: UsageEvent) -> None:
        self.events.append(event)


class FanOutSink:
    """Hands each event to several sinks (the ledger, and whatever a caller added); one failing
    sink does not keep the event from the others."""

    def __init__(self, *sinks: UsageSink):
        self.sinks = sinks

    def emit(self, event: UsageEvent) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception:
                log.exception("usage sink %s failed for %s", type(sink).__name__, event.request_id)
