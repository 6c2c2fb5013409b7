"""Admission: the priority class a request runs at, and its RPM/TPM reservation.

A request reserves its prompt plus the most it may generate (max_tokens, else the rest of the
context), capped at the key's TPM so that any request fits an idle key; the reservation is
settled with the tokens actually used when the request ends.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from loraplex.billing.ratelimit import Decision, Limits, RateLimiter, RateLimiterUnavailable, Window
from loraplex.engine.api import PRIORITY_CLASSES
from loraplex.platform.auth import Principal
from loraplex.platform.errors import PlatformError, invalid
from loraplex.platform.metrics import Metrics

log = logging.getLogger("loraplex.platform")


def effective_priority(max_class: str, requested: str | None) -> str:
    """The key's class, or a lower one asked for with x-priority; a higher one is capped, never granted."""
    if requested is None or not requested.strip():
        return max_class
    wanted = requested.strip().lower()
    if wanted not in PRIORITY_CLASSES:
        raise invalid(f"x-priority must be one of {', '.join(PRIORITY_CLASSES)}, got {requested!r}", "x-priority")
    return PRIORITY_CLASSES[max(PRIORITY_CLASSES.index(wanted), PRIORITY_CLASSES.index(max_class))]


def _duration(seconds: float) -> str:
    """OpenAI's format for reset headers: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes >= 1 else f"{rest:.3g}s"


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, w in (("requests", decision.requests), ("tokens", decision.tokens)):
        if isinstance(w, Window):
            headers[f"x-ratelimit-limit-{kind}"] = str(w.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(w.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = _duration(w.reset_s)
    if not decision.allowed:
        headers["retry-after"] = str(max(1, math.ceil(decision.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(decision.retry_after_s * 1000)))
    return headers


@dataclass
class Ticket:
    """An admitted request's reservation; `settle` hands back what it did not use."""

    principal: Principal
    reserved: int
    headers: dict[str, str]
    settled: bool = False


class Admission:
    def __init__(self, limiter: RateLimiter, metrics: Metrics, fail_open: bool = False):
        self._limiter = limiter
        self._metrics = metrics
        self._fail_open = fail_open
        self._last_warning = 0.0

    async def admit(self, principal: Principal, prompt_tokens: int, max_new_tokens: int) -> Ticket:
        limits: Limits = principal.limits
        if not limits.any:
            return Ticket(principal, 0, {})
        try:
            decision = await self._limiter.acquire(principal.rate_subject, limits, prompt_tokens + max_new_tokens)
        except RateLimiterUnavailable as exc:
            return self._unavailable(principal, exc)
        headers = ratelimit_headers(decision)
        if not decision.allowed:
            kind = decision.refused
            self._metrics.rate_limited.labels(kind).inc()
            limit = limits.rpm if kind == "requests" else limits.tpm
            raise PlatformError(
                429, f"Rate limit reached for {kind} per minute (limit {limit}). "
                     f"Please try again in {headers['retry-after']}s.",
                code="rate_limit_exceeded", type=kind, headers=headers)
        return Ticket(principal, decision.reserved_tokens, headers)

    async def settle(self, ticket: Ticket, used_tokens: int) -> None:
        if ticket.settled:
            return
        ticket.settled = True
        if not ticket.principal.limits.tpm:
            return
        try:
            await self._limiter.settle(ticket.principal.rate_subject, ticket.principal.limits, ticket.reserved,
                                       used_tokens)
        except RateLimiterUnavailable as exc:
            self._warn(f"could not settle a token reservation: {exc}")

    def _unavailable(self, principal: Principal, exc: RateLimiterUnavailable) -> Ticket:
        if self._fail_open:
            self._metrics.limiter_errors.labels("admitted").inc()
            self._warn(f"rate limiter unavailable, admitting without limits (fail-open): {exc}")
            return Ticket(principal, 0, {}, settled=True)
        self._metrics.limiter_errors.labels("refused").inc()
        self._warn(f"rate limiter unavailable, refusing requests (fail-closed): {exc}")
        raise PlatformError(503, "Rate limiting is unavailable (its Redis store cannot be reached), so requests are "
                                 "refused. Try again shortly.", code="rate_limiter_unavailable")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10:
            self._last_warning = now
            log.warning(message)
