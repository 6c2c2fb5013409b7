"""What a worker and the fleet send each other: the engine API's dataclasses as JSON, and errors.

The dataclasses of `engine.api` go over the wire as they are (msgspec encodes and decodes them,
bytes as base64), so a field added there travels without a change here. An EngineError travels as
{"error": {"kind", "code", "message", "param"}}, and comes back as the same class with the same code,
so the platform answers a remote failure exactly as a local one.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from loraplex.engine.api import (
    ContextLengthExceededError,
    EngineError,
    EngineStats,
    InvalidRequestError,
    ModelInfo,
    ModelNotFoundError,
    Usage,
)

T = TypeVar("T")

# The shared secret of a fleet: a worker started with it refuses calls without it, and `serve --worker`
# sends it.
WORKER_TOKEN_ENV = "LORAPLEX_WORKER_TOKEN"

# A generate stream with nothing to say (a request queued, a long prefill) sends an empty line this
# often, so that a caller can tell a quiet worker from a hung one: one silent for STREAM_IDLE_S is lost.
HEARTBEAT_S = 5.0
STREAM_IDLE_S = 30.0

# Checked in this order, so a subclass comes before its base.
_KINDS: tuple[tuple[str, type[EngineError], int], ...] = (
    ("context_length", ContextLengthExceededError, 400),
    ("model_not_found", ModelNotFoundError, 404),
    ("invalid_request", InvalidRequestError, 400),
    ("engine", EngineError, 500),
)


class WireError(Exception):
    """A body that does not decode as what was expected."""


class Health(msgspec.Struct, frozen=True):
    """A worker's answer to GET /engine/health: which process it is (a restarted worker has a new
    instance and has forgotten its adapters), its models, and its engine's figures."""

    instance: str
    models: list[ModelInfo]
    stats: EngineStats


class AdapterIn(msgspec.Struct, frozen=True):
    adapter_id: str
    path: str
    base_model: str | None = None


class Aborted(msgspec.Struct, frozen=True):
    usage: Usage | None


class Present(msgspec.Struct, frozen=True):
    present: bool


_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def decode(data: bytes | str, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.DecodeError as exc:  # (ValidationError is a DecodeError)
        raise WireError(f"not a valid {kind.__name__}: {exc}") from None


def error_body(exc: EngineError) -> tuple[int, bytes]:
    """The HTTP status and body a worker answers for an EngineError."""
    kind, status = next((k, s) for k, cls, s in _KINDS if isinstance(exc, cls))
    return status, encode({"error": {"kind": kind, "code": exc.code, "message": exc.message, "param": exc.param}})


def error_from(status: int, data: bytes) -> EngineError:
    """The EngineError a worker's error answer stands for; anything else (a proxy's page, a crash)
    is an EngineError naming the status."""
    try:
        body = msgspec.json.decode(data).get("error")
        cls = next(c for k, c, _ in _KINDS if k == body["kind"])
        exc = cls(str(body["message"]), body.get("param"))
    except (msgspec.DecodeError, AttributeError, KeyError, TypeError, StopIteration):
        return EngineError(f"worker answered HTTP {status}: {data[:200].decode(errors='replace')}")
    if body.get("code") and body["code"] != cls.code:
        exc.code = str(body["code"])  # a subclass's code (invalid_adapter) rides on its base class
    return exc
