"""Which database errors are an outage (keep and retry) and which are the database refusing what it was sent.

- Outage: the connection refused, reset or timed out, the server shutting down or out of connections, a deadlock.
  The same statement succeeds later, so whatever failed is kept and retried.
- Refusal: SQLSTATE class 22 (data exception: a value out of range, a string too long for its column) or class 23
  (integrity: a failed check). It fails the same way every time, so retrying it would block everything behind it:
  the ledger isolates and quarantines such events.
- asyncpg reports values it cannot encode (an int beyond int4) as SQLSTATE 22000 too. SQLite has no SQLSTATE: its
  IntegrityError is a refusal, and it raises a bare OverflowError for an integer beyond int8.
- Anything not known to be a refusal counts as an outage: kept, never dropped.
"""

from __future__ import annotations

from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError

_REFUSED_CLASSES = ("22", "23")
# A unique violation on the ledger's idempotency key is a concurrent writer's row, not bad data:
# `ON CONFLICT DO NOTHING` normally absorbs it; if it surfaces, the retry finds the row there.
_IDEMPOTENT = "uq_usage_ledger_request_id"


def _chain(exc: BaseException):
    """The error, what SQLAlchemy wrapped (`orig`) and what that was raised from (`from`, not an
    error that merely happened before it)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = getattr(exc, "orig", None) or exc.__cause__


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE the server (or asyncpg) gave, if any."""
    for e in _chain(exc):
        code = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
        if isinstance(code, str) and len(code) == 5:
            return code
    return None


def is_refusal(exc: BaseException) -> bool:
    """The database refused the statement's data: the same data will fail again."""
    if _IDEMPOTENT in str(exc):
        return False
    code = sqlstate(exc)
    if code is not None:
        return code[:2] in _REFUSED_CLASSES
    if isinstance(exc, IntegrityError | DataError):
        return True
    # A value the driver could not encode (SQLite's int beyond int8), raised bare or wrapped.
    return any(isinstance(e, OverflowError | ValueError | TypeError) for e in (exc, getattr(exc, "orig", None)))


def is_outage(exc: BaseException) -> bool:
    """A database error that passes with time: the connection, not the data. Errors from outside
    the database (a bug) are neither."""
    if is_refusal(exc):
        return False
    return isinstance(exc, SQLAlchemyError | OSError | TimeoutError) or type(exc).__module__.startswith("asyncpg")
