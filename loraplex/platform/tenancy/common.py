"""Shared checks for the tenancy services."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.errors import conflict, invalid, shown

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # matched whole: "acme\n" is no name
T = TypeVar("T")


def check_name(value: str, what: str, param: str = "name") -> str:
    """Names of tenants and adapters: 1-64 of letters, digits, '.', '_', '-' (no ':', which
    separates a base model from an adapter in a request's `model`)."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise invalid(f"{what} name must be 1-64 letters, digits, '.', '_' or '-' and start with a letter or "
                      f"digit, got {shown(value) if isinstance(value, str) else value!r}", param)
    return value


async def commit_or_conflict(session: AsyncSession, what: str, work: Callable[[], Awaitable[T]]) -> T:
    """Runs `work`, commits, and turns a unique-constraint race into a 409 with nothing written."""
    try:
        result = await work()
        await session.commit()
    except IntegrityError:
        await session.rollback()
        raise conflict(f"{what} already exists") from None
    except BaseException:
        await session.rollback()
        raise
    return result
