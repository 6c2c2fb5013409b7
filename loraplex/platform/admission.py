"""Admission: the priority class a request runs at, and its budget and RPM/TPM reservation.

- A request reserves its prompt (once) plus the most its n choices may generate (each max_tokens, else what fits in
  the context, capped by the tenant's default) on its budget counters, and the same capped at the key's TPM in its
  token bucket, so that any request fits an idle key.
- Both are checked and taken in one store operation (billing.quota), and settled with the tokens actually used when
  the request ends.
- Over a budget: 429 insufficient_quota with x-should-retry: false; over a rate: 429 rate_limit_exceeded with
  retry-after.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from datetime import datetime

from loraplex.billing.budgets import BudgetRule
from loraplex.billing.counters import CountersUnavailable
from loraplex.billing.ledger import LedgerWriter
from loraplex.billing.quota import AdmitRequest, Quota
from loraplex.billing.ratelimit import Decision, Window
from loraplex.billing.tail import Charge
from loraplex.engine.api import PRIORITY_CLASSES
from loraplex.platform.auth import Principal
from loraplex.platform.errors import PlatformError, invalid
from loraplex.platform.metrics import Metrics

log = logging.getLogger("loraplex.platform")
# A budget refusal stays refused until the period turns or the budget is raised: OpenAI's clients
# read this header and do not retry it (a rate-limit 429 is retried after retry-after).
NO_RETRY = {"x-should-retry": "false"}


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
    """An admitted request's charge on its budgets and buckets; `settle` replaces it by what it used."""

    principal: Principal
    charge: Charge
    at: datetime  # arrival: which periods it charges
    headers: dict[str, str]
    settled: bool = False


def budget_label(rule: BudgetRule) -> str:
    """The soft-limit metrics' name of a budget, "tenant day" or "key month": a key's budget is named
    by scope and period only, never by the key's prefix (no label carries a credential's start)."""
    return f"{rule.scope} {rule.period}"


def budget_name(principal: Principal, rule: BudgetRule) -> str:
    """The budget as the caller's 429 and the operator's log name it ("key lpx-1a2b day")."""
    scope = "tenant" if rule.scope == "tenant" else f"key {principal.key_prefix}"
    return f"{scope} {rule.period}"


class Admission:
    """The budget and rate-limit checks of one request, and its settlement, in one store round trip each."""

    def __init__(self, quota: Quota, ledger: LedgerWriter, metrics: Metrics, fail_open: bool = False,
                 ledger_fail_open: bool = True):
        self._quota = quota
        self._ledger = ledger
        self._metrics = metrics
        self._fail_open = fail_open
        self._ledger_fail_open = ledger_fail_open
        self._last_warning = 0.0

    async def admit(self, principal: Principal, request_id: str, at: datetime, prompt_tokens: int,
                    max_new_tokens: int) -> Ticket:
        if not self._ledger_fail_open and self._ledger.down:
            raise PlatformError(503, "Usage cannot be recorded right now (the ledger database is unreachable), so "
                                     "requests are refused. Try again shortly.", code="ledger_unavailable")
        tokens = prompt_tokens + max_new_tokens
        req = AdmitRequest(request_id, principal.tenant_id, principal.key_id, at, tokens, principal.budgets,
                           principal.limits, tokens)
        try:
            verdict = await self._quota.admit(req)
        except CountersUnavailable as exc:
            return self._unavailable(principal, req, exc)
        headers = ratelimit_headers(verdict.decision) if verdict.decision else {}
        if verdict.refused == "quota":
            self._metrics.budget_rejections.labels(verdict.rule.scope).inc()
            raise PlatformError(
                429, f"You exceeded your token budget: the {budget_name(principal, verdict.rule)} budget allows "
                     f"{verdict.rule.limit_tokens} tokens, {verdict.held} are used or reserved, and this request "
                     f"needs up to {tokens} (prompt + max_tokens for each choice).",
                code="insufficient_quota", type="insufficient_quota", headers={**headers, **NO_RETRY})
        if verdict.refused:
            kind = verdict.refused
            self._metrics.rate_limited.labels(kind).inc()
            limit = principal.limits.rpm if kind == "requests" else principal.limits.tpm
            raise PlatformError(
                429, f"Rate limit reached for {kind} per minute (limit {limit}). "
                     f"Please try again in {headers['retry-after']}s.",
                code="rate_limit_exceeded", type=kind, headers=headers)
        return Ticket(principal, verdict.charge, at, headers)

    async def settle(self, ticket: Ticket, used_tokens: int) -> None:
        """Exactly once per ticket, whatever ended the request."""
        if ticket.settled:
            return
        ticket.settled = True
        after = await self._quota.settle(ticket.charge, used_tokens)
        for rule in ticket.principal.budgets:
            total = after.get(rule.counter(ticket.charge.key_id, ticket.at))
            if rule.soft_limit_tokens and total is not None:
                self._soft_limit(ticket.principal, rule, total - used_tokens, total)

    def _soft_limit(self, principal: Principal, rule: BudgetRule, before: int, after: int) -> None:
        label = budget_label(rule)
        reached = after >= rule.soft_limit_tokens
        self._metrics.soft_limit_reached.labels(principal.tenant, label).set(int(reached))
        if reached and before < rule.soft_limit_tokens:
            self._metrics.soft_limit_alerts.labels(principal.tenant, label).inc()
            log.warning("tenant %s passed the soft limit of its %s budget: %d of %d tokens (limit %d)",
                        principal.tenant, budget_name(principal, rule), after, rule.soft_limit_tokens,
                        rule.limit_tokens)

    def _unavailable(self, principal: Principal, req: AdmitRequest, exc: CountersUnavailable) -> Ticket:
        unlimited = not principal.limits.any and not principal.budgets
        if self._fail_open or unlimited:  # nothing to enforce, or told to admit: count it once we can
            self._metrics.limiter_errors.labels("admitted").inc()
            self._warn(f"budget and rate-limit counters unavailable, admitting and counting later: {exc}")
            return Ticket(principal, self._quota.admit_unchecked(req), req.at, {})
        self._metrics.limiter_errors.labels("refused").inc()
        self._warn(f"budget and rate-limit counters unavailable, refusing requests (fail-closed): {exc}")
        raise PlatformError(503, "Rate limiting and budgets are unavailable (their Redis store or the ledger cannot "
                                 "be reached), so requests are refused. Try again shortly.",
                            code="rate_limiter_unavailable")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10:
            self._last_warning = now
            log.warning(message)
