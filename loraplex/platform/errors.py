"""Every failure leaves as an OpenAI-shaped body: {"error": {"message", "type", "param", "code"}}.

PlatformError is what our own code raises; the handlers below also turn Litestar's errors
(validation, unknown route, wrong method), engine errors and storage outages into that shape.
Messages never contain an API key or the Authorization header.
"""

from __future__ import annotations

import logging
import re

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from sqlalchemy.exc import DataError, DBAPIError, OperationalError

from loraplex.billing.db_errors import sqlstate
from loraplex.engine.api import (
    ContextLengthExceededError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
)

log = logging.getLogger("loraplex.platform")
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
SHOWN_NAME_CHARS = 64  # how much of a name an error message repeats: a 1 MB model name is not echoed
# What tenant or admin input raises deep in a library (a date out of range, a number too big for a
# timedelta, JSON nested past the recursion limit): a 400 for that request, never a 500.
BAD_INPUT_ERRORS = (ValueError, OverflowError, RecursionError)


class PlatformError(ValueError):
    """An error with its HTTP status and OpenAI fields. A ValueError, so the CLI prints it as one line."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> PlatformError:
    return PlatformError(400, message, code=code, param=param)


def not_found(message: str, param: str | None = None, code: str = "not_found") -> PlatformError:
    return PlatformError(404, message, code=code, param=param)


def conflict(message: str, param: str | None = None) -> PlatformError:
    return PlatformError(409, message, code="already_exists", param=param)


def shown(name: str, limit: int = SHOWN_NAME_CHARS) -> str:
    """A name as an error message repeats it: whole when short, else its start and a count."""
    if len(name) <= limit:
        return name
    return f"{name[:limit]}... ({len(name)} characters)"


def model_not_found(model: str) -> PlatformError:
    """The one answer for a model that is missing, another tenant's, or not allowed to this key."""
    return not_found(f"The model `{shown(model)}` does not exist or you do not have access to it.", "model",
                     code="model_not_found")


def unauthorized(message: str) -> PlatformError:
    return PlatformError(401, message, code="invalid_api_key")


def error_response(exc: PlatformError) -> Response:
    body = {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}
    return Response(body, status_code=exc.status, headers=exc.headers)


def from_engine_error(exc: EngineError) -> PlatformError:
    if isinstance(exc, ContextLengthExceededError):
        return invalid(exc.message, exc.param, code="context_length_exceeded")
    if isinstance(exc, ModelNotFoundError):
        return not_found(exc.message, exc.param or "model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        return invalid(exc.message, exc.param, code=exc.code)
    if isinstance(exc, EngineUnavailableError):
        log.warning("engine unavailable: %s", exc.message)
        return PlatformError(503, "The engine is unavailable; try again shortly.", code=exc.code,
                             headers={"retry-after": "1"})
    log.error("engine error: %s", exc.message)
    return PlatformError(500, "The engine failed to process the request.", code=exc.code)


def _from_http_exception(exc: HTTPException) -> PlatformError:
    if isinstance(exc, ValidationException):
        problems = [e for e in (exc.extra or []) if isinstance(e, dict)]
        if problems:
            message = shown(str(problems[0].get("message", "invalid value")), 300)  # it may quote the value
            key = problems[0].get("key")
            if key in (None, "data"):  # the body itself: name the missing field, if that is the problem
                missing = _MISSING_FIELD.search(message)
                key = missing.group(1) if missing else None
            where = f" (at `{key}`)" if key else ""
            return invalid(f"Invalid request body: {message}{where}", key)
        return invalid(f"Invalid request: {exc.detail}")
    status = exc.status_code
    if status == 404:
        return not_found("Unknown URL: no route matches this path.", code="unknown_url")
    if status == 405:
        return PlatformError(405, f"Method not allowed: {exc.detail}", code="method_not_allowed",
                             headers=dict(exc.headers or {}))
    return PlatformError(status, str(exc.detail), code=None, headers=dict(exc.headers or {}))


def platform_error_of(request: Request, exc: Exception) -> PlatformError:
    """Any exception as the error a caller is shown (logged where it is the server's fault)."""
    if isinstance(exc, PlatformError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    if isinstance(exc, HTTPException):
        if exc.status_code == 413:
            limit = request.route_handler.resolve_request_max_body_size()
            return PlatformError(413, f"The request body is larger than this endpoint's limit of {limit} bytes.",
                                 code="request_too_large")
        return _from_http_exception(exc)
    if isinstance(exc, BAD_INPUT_ERRORS):
        return bad_input(request, exc)
    if isinstance(exc, DataError) or (isinstance(exc, DBAPIError) and (sqlstate(exc) or "")[:2] == "22"):
        # a value the database cannot store (too long, out of range, a NUL in text): the input's fault
        log.warning("value refused by the database on %s %s: %s", request.method, request.url.path,
                    type(exc.orig).__name__)
        return invalid("A value in the request is too long or out of range.", code="invalid_value")
    if isinstance(exc, OperationalError | DBAPIError | ConnectionError | OSError):
        log.error("storage unavailable on %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return PlatformError(503, "The platform's database is unavailable; try again later.",
                             code="database_unavailable")
    log.exception("internal error on %s %s", request.method, request.url.path)
    return PlatformError(500, "Internal server error.", code="internal_error")


def bad_input(request: Request, exc: BaseException) -> PlatformError:
    """The last resort for BAD_INPUT_ERRORS that no check caught at its source: a 400 that does not
    repeat the input (it may be huge), logged as a warning without a traceback (it may be deep)."""
    log.warning("bad input on %s %s: %s", request.method, request.url.path, type(exc).__name__)
    if isinstance(exc, RecursionError):
        return invalid("The request is nested too deeply.", code="too_deeply_nested")
    return invalid("A value in the request is out of range or malformed.")


def handle_exception(request: Request, exc: Exception) -> Response:
    """Litestar's app-level handler for every exception."""
    return error_response(platform_error_of(request, exc))
