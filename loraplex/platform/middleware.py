"""A request id on every response and requests counted by status, as a Litestar before_send hook.

before_send sees every response the app sends, including 404s for unknown routes and error
bodies, which route-level middleware would miss.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from litestar.types import Message, Scope

from loraplex.platform.metrics import Metrics, endpoint_label

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
