"""Budget counters and RPM/TPM buckets behind one interface, and the in-process store.

Every operation works on one tenant and is atomic: in Redis one Lua script (redis_counters.py),
here plain code with no await inside. The counters of a tenant belong to an *epoch*, named by a
marker `<generation>|<epoch id>|<ledger high-water mark>`; an operation names the marker its
caller believes in and is refused, changing nothing, when it is not the current one:

- "missing": no valid marker (never built, Redis flushed or restarted, epoch expired, or the
  generation was bumped because a process died): rebuild from the ledger first;
- "stale": the counters were rebuilt since: adopt the new epoch first (quota.Quota does both).

A counter holds {u: tokens used, r: tokens reserved}; a counter that does not exist is zero.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Protocol

from loraplex.billing.ratelimit import Decision, Limits, MemoryRateLimiter
from loraplex.billing.tail import Charge

EPOCH_TTL_S = 24 * 3600  # a tenant's counters are rebuilt from the ledger at least this often
REBUILD_LOCK_S = 15.0  # how long one process may take to rebuild before another tries


class CountersUnavailable(Exception):
    """The shared counter store cannot be reached, or the ledger needed to rebuild it."""


@dataclass(frozen=True)
class Outcome:
    status: str  # ok, missing, stale, quota, rate, busy, exists, lost
    marker: str | None = None  # stale/exists: the current marker; begin_rebuild ok: the generation
    decision: Decision | None = None  # the RPM/TPM windows (ok, rate)
    refused: int = -1  # quota: the index of the counter over its limit
    held: int = 0  # quota: what that counter holds (used + reserved)
    used: tuple[int, ...] = ()  # settle: each counter's tokens used, after


MISSING = Outcome("missing")


def marker_valid(marker: str | None, generation: str | None) -> bool:
    return bool(marker) and bool(generation) and marker.startswith(f"{generation}|")


def marker_hwm(marker: str) -> int:
    return int(marker.rsplit("|", 1)[1])


class CounterStore(Protocol):
    async def admit(self, tenant_id: int, marker: str, charge: Charge, limits: tuple[int, ...], rate: Limits,
                    rate_tokens: int) -> Outcome:
        """Checks every limited counter (used + reserved + charge.reserved <= limit) and the RPM/TPM
        buckets; all pass: reserves on every counter and takes from the buckets, else nothing."""
        ...

    async def settle(self, tenant_id: int, marker: str, charge: Charge, used: int) -> Outcome:
        """Replaces the charge's reservation by `used` on its counters and refunds its TPM bucket."""
        ...

    async def adopt(self, tenant_id: int, marker: str, deltas: dict[str, tuple[int, int]]) -> Outcome:
        """Adds (reserved, used) deltas to counters of the current epoch."""
        ...

    async def marker(self, tenant_id: int) -> str | None: ...

    async def begin_rebuild(self, tenant_id: int, token: str) -> Outcome:
        """ok (marker = the generation to build under) / exists (someone finished) / busy."""
        ...

    async def finish_rebuild(self, tenant_id: int, token: str, marker: str, used: dict[str, int]) -> bool: ...

    async def invalidate(self, tenant_id: int) -> None: ...

    async def heartbeat(self, instance: str, leaving: bool = False) -> int:
        """Marks this process alive (or gone); returns how many dead processes it found (each
        bumps the generation: their reservations can only be cleared by rebuilding)."""
        ...

    async def read(self, tenant_id: int, marker: str,
                   counters: tuple[str, ...]) -> dict[str, tuple[int, int]] | None:
        """(used, reserved) per counter; None when `marker` is not the current epoch."""
        ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


class MemoryCounters:
    """The in-process store of embedded mode: one process, so nobody else can rebuild or die."""

    def __init__(self, clock=time.monotonic, epoch_ttl_s: float = EPOCH_TTL_S):
        self._clock = clock
        self._ttl = epoch_ttl_s
        self._generation = secrets.token_hex(4)
        self._markers: dict[int, tuple[str, float]] = {}  # tenant -> (marker, expires)
        self._values: dict[int, dict[str, list[int]]] = {}  # tenant -> counter -> [used, reserved]
        self._rebuilding: dict[int, tuple[str, float]] = {}
        self._buckets = MemoryRateLimiter(clock)

    def _current(self, tenant_id: int) -> str | None:
        found = self._markers.get(tenant_id)
        if found is None or found[1] <= self._clock():
            return None
        return found[0]

    def _problem(self, tenant_id: int, marker: str) -> Outcome | None:
        current = self._current(tenant_id)
        if current is None:
            return MISSING
        return None if current == marker else Outcome("stale", current)

    def _counter(self, tenant_id: int, name: str) -> list[int]:
        return self._values.setdefault(tenant_id, {}).setdefault(name, [0, 0])

    async def admit(self, tenant_id, marker, charge, limits, rate, rate_tokens) -> Outcome:
        problem = self._problem(tenant_id, marker)
        if problem:
            return problem
        for i, (name, limit) in enumerate(zip(charge.counters, limits, strict=True)):
            held = sum(self._counter(tenant_id, name))
            if limit and held + charge.reserved > limit:
                return Outcome("quota", refused=i, held=held)
        decision = await self._buckets.acquire(f"key:{charge.key_id}", rate, rate_tokens)
        if not decision.allowed:
            return Outcome("rate", decision=decision)
        for name in charge.counters:
            self._counter(tenant_id, name)[1] += charge.reserved
        return Outcome("ok", decision=decision)

    async def settle(self, tenant_id, marker, charge, used) -> Outcome:
        problem = self._problem(tenant_id, marker)
        if problem:
            return problem
        if charge.tpm:
            await self._buckets.settle(f"key:{charge.key_id}", Limits(tpm=charge.tpm), charge.tpm_reserved, used)
        after = []
        for name in charge.counters:
            counter = self._counter(tenant_id, name)
            counter[1] -= charge.reserved
            counter[0] += used
            after.append(counter[0])
        return Outcome("ok", used=tuple(after))

    async def adopt(self, tenant_id, marker, deltas) -> Outcome:
        problem = self._problem(tenant_id, marker)
        if problem:
            return problem
        for name, (reserved, used) in deltas.items():
            counter = self._counter(tenant_id, name)
            counter[0] += used
            counter[1] += reserved
        return Outcome("ok")

    async def marker(self, tenant_id) -> str | None:
        return self._current(tenant_id)

    async def begin_rebuild(self, tenant_id, token) -> Outcome:
        current = self._current(tenant_id)
        if current is not None:
            return Outcome("exists", current)
        holder = self._rebuilding.get(tenant_id)
        if holder is not None and holder[1] > self._clock():
            return Outcome("busy")
        self._rebuilding[tenant_id] = (token, self._clock() + REBUILD_LOCK_S)
        return Outcome("ok", self._generation)

    async def finish_rebuild(self, tenant_id, token, marker, used) -> bool:
        holder = self._rebuilding.get(tenant_id)
        if holder is None or holder[0] != token:
            return False
        del self._rebuilding[tenant_id]
        if not marker_valid(marker, self._generation):
            return False
        self._markers[tenant_id] = (marker, self._clock() + self._ttl)
        self._values[tenant_id] = {name: [value, 0] for name, value in used.items() if value}
        return True

    async def invalidate(self, tenant_id) -> None:
        self._markers.pop(tenant_id, None)

    async def heartbeat(self, instance, leaving=False) -> int:
        return 0

    async def read(self, tenant_id, marker, counters) -> dict[str, tuple[int, int]] | None:
        if self._current(tenant_id) != marker:
            return None
        values = self._values.get(tenant_id, {})
        return {name: tuple(values.get(name, (0, 0))) for name in counters}

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._values.clear()
        self._markers.clear()
