"""Serving from what is cached while the database is unreachable.

The key and catalog caches re-read the database every fraction of a second; when that read fails
with the database down, the last answer keeps being used for up to `grace_s`, so requests go on
being served (their usage goes to the ledger's spool) instead of every one answering 503.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError

log = logging.getLogger("loraplex.platform")
T = TypeVar("T")
OUTAGE_ERRORS = (DBAPIError, OSError)
_last_warning = [0.0]


async def load_or_stale(load: Callable[[], Awaitable[T]], cached: tuple[float, T] | None, now: float,
                        grace_s: float, what: str) -> tuple[float, T]:
    """(loaded at, value) fresh from `load`, or the cached pair if the database is down and the
    cache is younger than `grace_s`."""
    try:
        return now, await load()
    except OUTAGE_ERRORS as exc:
        if cached is None or now - cached[0] >= grace_s:
            raise
        if time.monotonic() - _last_warning[0] > 10:
            _last_warning[0] = time.monotonic()
            log.warning("database unreachable (%s): serving cached %s", type(exc).__name__, what)
        return cached
