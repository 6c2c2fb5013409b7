"""Failed authentication per client address, so that guessing credentials is slow and a flood of bad keys is cheap.

- After `max_failures` within `window_s`, the address is refused (429 with retry-after) until the oldest of those
  failures leaves the window, even with the right credentials: guessing costs `window_s` per `max_failures` tries,
  and a flood of made-up keys costs the database nothing once its address is locked.
- Two limits use it: wrong admin tokens (the admin API's bearer check and the admin UI's login; a success clears the
  address's count) and failed tenant authentication on the tenant API (every 401 there counts, through
  `FailedAuthLimit`, an ASGI middleware that answers a locked address before anything of its request is read).
- The counts live in this process: with N instances behind a balancer, a guesser gets N times the tries.
- Behind a reverse proxy every client shares the proxy's address, so one client's failures also lock the others out
  for the window; `LORAPLEX_ADMIN_AUTH_MAX_FAILURES=0` / `LORAPLEX_AUTH_MAX_FAILURES=0` turn the limits off where that
  matters more.
- Memory is bounded: at most MAX_ADDRESSES addresses, each with at most `max_failures` times.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.errors import PlatformError

MAX_ADDRESSES = 10_000  # addresses tracked at once; the least recently failed are forgotten first


class AuthThrottle:
    """Failure times per address, oldest first, within the window."""

    def __init__(self, max_failures: int = 10, window_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 what: str = "wrong admin tokens"):
        self.max_failures, self.window_s, self._clock, self._what = max_failures, window_s, clock, what
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()  # address -> failure times, oldest first

    def check(self, address: str) -> None:
        """Raises 429 while `address` has used up its failures."""
        if not self.max_failures:
            return
        failures = self._recent(address)
        if failures is not None and len(failures) >= self.max_failures:
            wait = math.ceil(failures[0] + self.window_s - self._clock())
            raise PlatformError(429, f"Too many {self._what} from this address; try again in {wait} s.",
                                code="too_many_auth_failures", headers={"retry-after": str(wait)})

    def record(self, address: str, ok: bool) -> None:
        if not self.max_failures:
            return
        if ok:
            self._failures.pop(address, None)
            return
        failures = self._recent(address)
        if failures is None:
            failures = self._failures[address] = deque(maxlen=self.max_failures)
            while len(self._failures) > MAX_ADDRESSES:
                self._failures.popitem(last=False)
        failures.append(self._clock())
        self._failures.move_to_end(address)

    def __len__(self) -> int:
        return len(self._failures)

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


AdminAuthThrottle = AuthThrottle  # the name the admin API and its tests know it by


class FailedAuthLimit:
    """ASGI middleware over the routes under `prefix`: counts the 401s answered to each address and
    refuses a locked address with the throttle's 429 before its request is authenticated or read."""

    def __init__(self, app: ASGIApp, throttle: AuthThrottle, prefix: str = "/v1/"):
        self.app, self.throttle, self.prefix = app, throttle, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.throttle.max_failures or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        address = client[0] if client else "unknown"
        self.throttle.check(address)  # the app's exception handler answers the 429

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 401:
                self.throttle.record(address, ok=False)
            await send(message)

        await self.app(scope, receive, counting_send)
