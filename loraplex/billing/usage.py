"""The usage hook: one event per finished request, handed to a sink.

The platform calls `UsageSink.emit` once per request, whatever its outcome; the ledger of the
billing issue (batched inserts keyed by request_id, a local spool while the database is down)
implements the same protocol. `emit` must not block: it runs on the request's event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("loraplex.usage")


@dataclass(frozen=True)
class UsageEvent:
    """What one request consumed. `request_id` is the idempotency key of the ledger row."""

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
    status: str  # "ok", "client_disconnected", "error"
    finish_reason: str | None
    endpoint: str = "chat.completions"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageSink(Protocol):
    def emit(self, event: UsageEvent) -> None: ...


class LogUsageSink:
    """Default sink until the ledger lands: one debug line per request."""

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
