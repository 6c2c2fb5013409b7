"""Per-key RPM/TPM limits as two token buckets, and the in-process store.

Each limit is a bucket of `limit` units refilled at `limit / 60` per second: a key may burst up to
its per-minute limit, then runs at the steady rate. Admission takes one request and a reservation
of tokens (prompt + max completion) from both buckets at once, or from neither; `settle` gives
back what the finished request did not use. The Redis store (redis_ratelimit.py) runs the same
arithmetic in one Lua script so that every app instance shares the buckets.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

WINDOW_S = 60.0


class RateLimiterUnavailable(Exception):
    """The shared counter store cannot be reached (Redis down)."""


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None  # None: no limit
    tpm: int | None = None

    @property
    def any(self) -> bool:
        return bool(self.rpm) or bool(self.tpm)


@dataclass(frozen=True)
class Window:
    """One bucket as the x-ratelimit-* headers report it."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True)
class Decision:
    allowed: bool
    requests: Window | None = None
    tokens: Window | None = None
    retry_after_s: float = 0.0
    reserved_tokens: int = 0  # what `settle` must be told was reserved

    @property
    def refused(self) -> str | None:
        """Which limit refused: "requests" or "tokens" (None when allowed)."""
        if self.allowed:
            return None
        return "requests" if self.requests is not None and self.requests.remaining < 1 else "tokens"


class RateLimiter(Protocol):
    async def acquire(self, subject: str, limits: Limits, tokens: int) -> Decision:
        """Takes one request and `tokens` (capped at the TPM limit) for `subject`, atomically."""
        ...

    async def settle(self, subject: str, limits: Limits, reserved: int, used: int) -> None:
        """Returns `reserved - used` tokens to the bucket (a negative difference is a debt)."""
        ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


def window(limit: int, level: float) -> Window:
    rate = limit / WINDOW_S
    return Window(limit=limit, remaining=max(0, math.floor(level)), reset_s=max(0.0, (limit - level) / rate))


class _Bucket:
    __slots__ = ("level", "stamp")

    def __init__(self, level: float, stamp: float):
        self.level, self.stamp = level, stamp

    def refill(self, limit: int, now: float) -> float:
        self.level = min(float(limit), self.level + max(0.0, now - self.stamp) * limit / WINDOW_S)
        self.stamp = now
        return self.level


class MemoryRateLimiter:
    """The in-process store of embedded mode: the same buckets, in a dict, for one instance."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def _bucket(self, subject: str, kind: str, limit: int, now: float) -> _Bucket:
        b = self._buckets.get((subject, kind))
        if b is None:
            b = self._buckets[(subject, kind)] = _Bucket(float(limit), now)
        b.refill(limit, now)
        return b

    async def acquire(self, subject: str, limits: Limits, tokens: int) -> Decision:
        now = self._clock()
        wait, req, tok = 0.0, None, None
        cost = min(tokens, limits.tpm) if limits.tpm else 0
        if limits.rpm:
            req = self._bucket(subject, "req", limits.rpm, now)
            wait = max(wait, (1 - req.level) * WINDOW_S / limits.rpm)
        if limits.tpm:
            tok = self._bucket(subject, "tok", limits.tpm, now)
            wait = max(wait, (cost - tok.level) * WINDOW_S / limits.tpm)
        allowed = wait <= 0
        if allowed:
            if req is not None:
                req.level -= 1
            if tok is not None:
                tok.level -= cost
        return Decision(
            allowed=allowed,
            requests=window(limits.rpm, req.level) if req is not None else None,
            tokens=window(limits.tpm, tok.level) if tok is not None else None,
            retry_after_s=max(0.0, wait), reserved_tokens=cost if allowed else 0)

    async def settle(self, subject: str, limits: Limits, reserved: int, used: int) -> None:
        if not limits.tpm or reserved == used:
            return
        b = self._bucket(subject, "tok", limits.tpm, self._clock())
        b.level = min(float(limits.tpm), b.level + reserved - used)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._buckets.clear()
