"""Serving from what is cached while the database is unreachable, instead of answering every request 503.

- The key and catalog caches re-read the database every fraction of a second; when that read fails with the database
  down, the last answer keeps being used for up to `grace_s` (usage goes to the ledger's spool meanwhile).
- A database that refuses connections fails a read at once; one behind a network that drops packets does not answer,
  and the read would wait for the connect timeout (2 s), or on a pooled connection for the command timeout (30 s).
  So a read with a cached answer to fall back on waits at most `stale_after_s` (1 s: a key or catalog read takes
  milliseconds), then the cached answer is used and the read is cancelled. A read with nothing to fall back on waits
  for the database's own timeouts.
- Only an outage (billing.db_errors.is_outage) falls back: any other error is raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from loraplex.billing.db_errors import is_outage

log = logging.getLogger("loraplex.platform")
T = TypeVar("T")
STALE_AFTER_S = 1.0
_last_warning = [0.0]


async def load_or_stale(load: Callable[[], Awaitable[T]], cached: tuple[float, T] | None, now: float,
                        grace_s: float, what: str, stale_after_s: float = STALE_AFTER_S) -> tuple[float, T]:
    """(loaded at, value) fresh from `load`, or the cached pair if the database is down (or does
    not answer within `stale_after_s`) and the cache is younger than `grace_s`."""
    usable = cached is not None and now - cached[0] < grace_s
    try:
        if not usable:
            return now, await load()
        return now, await _within(load(), stale_after_s)
    except Exception as exc:
        if not usable or not is_outage(exc):
            raise
        if time.monotonic() - _last_warning[0] > 10:
            _last_warning[0] = time.monotonic()
            log.warning("database unreachable (%s): serving cached %s", type(exc).__name__, what)
        return cached


async def _within(work: Awaitable[T], timeout_s: float) -> T:
    """`work`'s result, or TimeoutError after `timeout_s` (the work is cancelled: SQLAlchemy
    then drops its connection rather than wait on it)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await work
    except TimeoutError:
        raise TimeoutError(f"the database did not answer within {timeout_s:g} s") from None
