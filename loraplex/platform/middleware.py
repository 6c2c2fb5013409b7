"""A request id on every response and requests counted by status, as a Litestar before_send hook;
and the drain a stopping server runs first, as a middleware that tracks the requests in flight.

before_send sees every response the app sends, including 404s for unknown routes and error
bodies, which route-level middleware would miss.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.errors import PlatformError
from loraplex.platform.metrics import Metrics, endpoint_label

# answered while draining, and never waited for
OPS_PATHS = frozenset(("/health", "/ready", "/metrics", "/metrics/endpoint-picker"))

SCOPE_KEY = "loraplex.request_id"


def request_hex(scope: Scope) -> str:
    """This request's id (hex), made on first use; x-request-id and the engine's id are `req_<hex>`."""
    rid = scope.get(SCOPE_KEY)  # type: ignore[call-overload]
    if rid is None:
        rid = scope[SCOPE_KEY] = secrets.token_hex(12)  # type: ignore[literal-required]
    return rid


def response_hook(metrics: Metrics) -> Callable[[Message, Scope], Awaitable[None]]:
    async def before_send(message: Message, scope: Scope) -> None:
        if message["type"] != "http.response.start":
            return
        header = (b"x-request-id", f"req_{request_hex(scope)}".encode())
        message["headers"] = [*message.get("headers", ()), header]  # type: ignore[typeddict-unknown-key]
        metrics.requests.labels(endpoint_label(scope["path"]), str(message["status"])).inc()

    return before_send


class Drain:
    """What a stopping server does first (SIGTERM, `serve`): refuse new generations with a 503, let
    the requests in flight finish for up to a timeout, then end those left: a stream as if its
    client had left (the platform's own path for that: its engine requests are aborted and it is
    billed what it generated), anything else by cancelling its task.

    `middleware` (a Litestar middleware, so it runs after routing) holds every request but the
    operations endpoints; while draining, a POST under /v1/ is refused before its key or body is
    read, and /ready answers 503 (ops.py)."""

    RETRY_AFTER_S = 1  # another instance can take the request at once
    GRACE_S = 0.5  # how long stopped streams get to close (abort, bill) before tasks are cancelled

    def __init__(self) -> None:
        self.draining = False
        self._requests: dict[asyncio.Task, _Receive] = {}

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def track(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] in OPS_PATHS:
                await app(scope, receive, send)
                return
            if self.draining and scope["method"] == "POST" and scope["path"].startswith("/v1/"):
                raise PlatformError(503, "The server is shutting down; retry the request (another instance "
                                         "will take it).", code="server_shutting_down",
                                    headers={"retry-after": str(self.RETRY_AFTER_S)})
            task, stoppable = asyncio.current_task(), _Receive(receive)
            started = False

            async def send_seen(message: Message) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            self._requests[task] = stoppable
            try:
                await app(scope, stoppable, send_seen)
            except asyncio.CancelledError:
                if not stoppable.stopped or started:
                    raise
                task.uncancel()  # cancelled by run(), before any answer: the client gets one
                raise PlatformError(503, "The server shut down before the request finished; retry it.",
                                    code="server_shutting_down",
                                    headers={"retry-after": str(self.RETRY_AFTER_S)}) from None
            finally:
                del self._requests[task]

        return track

    async def run(self, timeout_s: float) -> int:
        """Starts draining and returns once nothing is in flight: at once if idle, else when the
        requests finish or, after `timeout_s`, once those left are ended. Returns how many were."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = len(self._requests)
        for stoppable in self._requests.values():
            stoppable.stop()
        deadline = time.monotonic() + self.GRACE_S
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tasks = list(self._requests)
        for task in tasks:  # (a coroutine's `finally` still runs: a non-streamed generation is billed)
            task.cancel("the drain timeout passed")
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        return left


_DISCONNECT: Message = {"type": "http.disconnect"}  # type: ignore[typeddict-item]


class _Receive:
    """A request's ASGI receive that answers http.disconnect once stopped, even to a call waiting
    already (Litestar's streams wait in one for their client to leave): stop() cancels the task
    waiting in it, and the call turns that cancellation, when it is the only one, into the answer.
    (No task per call: receive is on every request's path.)"""

    __slots__ = ("_receive", "_waiter", "_stopped")

    def __init__(self, receive: Receive):
        self._receive = receive
        self._waiter: asyncio.Task | None = None
        self._stopped = False

    async def __call__(self) -> Message:
        if self._stopped:
            return _DISCONNECT
        self._waiter = asyncio.current_task()
        try:
            return await self._receive()
        except asyncio.CancelledError:
            if not self._stopped or self._waiter.uncancel() > 0:  # (cancelled by someone else too)
                raise
            return _DISCONNECT
        finally:
            self._waiter = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._waiter is not None:
            self._waiter.cancel("the drain timeout passed")
