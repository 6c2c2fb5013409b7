"""Wrong admin tokens per client address: after `max_failures` within `window_s`, the address is
refused (429 with retry-after) until the oldest of those failures leaves the window, even with the
right token, so guessing the token costs `window_s` per `max_failures` tries.

The admin API's bearer check and the admin UI's login share it. The count lives in this process:
with N instances behind a balancer, a guesser gets N times the tries. Behind a reverse proxy every
client shares the proxy's address, so a guesser there also locks the admins out for the window;
`LORAPLEX_ADMIN_AUTH_MAX_FAILURES=0` turns the limit off where that matters more.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from loraplex.platform.errors import PlatformError

MAX_ADDRESSES = 10_000  # addresses tracked at once; the least recently failed are forgotten first


class AdminAuthThrottle:
    def __init__(self, max_failures: int = 10, window_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.max_failures, self.window_s, self._clock = max_failures, window_s, clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()  # address -> failure times, oldest first

    def check(self, address: str) -> None:
        """Raises 429 while `address` has used up its failures."""
        if not self.max_failures:
            return
        failures = self._recent(address)
        if failures is not None and len(failures) >= self.max_failures:
            wait = math.ceil(failures[0] + self.window_s - self._clock())
            raise PlatformError(429, f"Too many wrong admin tokens from this address; try again in {wait} s.",
                                code="too_many_auth_failures", headers={"retry-after": str(wait)})

    def record(self, address: str, ok: bool) -> None:
        if not self.max_failures:
            return
        if ok:
            self._failures.pop(address, None)
            return
        failures = self._recent(address)
        if failures is None:
            failures = self._failures[address] = deque()
            while len(self._failures) > MAX_ADDRESSES:
                self._failures.popitem(last=False)
        failures.append(self._clock())
        self._failures.move_to_end(address)

    def _recent(self, address: str) -> deque[float] | None:
        """The address's failures within the window (older ones dropped), or None."""
        failures = self._failures.get(address)
        if failures is None:
            return None
        horizon = self._clock() - self.window_s
        while failures and failures[0] <= horizon:
            failures.popleft()
        if not failures:
            del self._failures[address]
            return None
        return failures
