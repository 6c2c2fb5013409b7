"""What the platform's CLI commands share: settings from the environment, one database session
per command, and storage failures as one clear line (`loraplex: error: ...`, exit 2)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from loraplex.platform.db.database import display_url, make_engine, session_factory
from loraplex.platform.db.migrate import current_revision, head_revision
from loraplex.platform.settings import Settings

T = TypeVar("T")


def run_db(work: Callable[[AsyncEngine], Awaitable[T]], settings: Settings | None = None) -> T:
    """Runs `work` on an engine for the configured database; connection problems become ValueError."""
    settings = settings or Settings.from_env()
    url = settings.effective_database_url

    async def main() -> T:
        engine = make_engine(url)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    try:
        return asyncio.run(main())
    except (DBAPIError, OSError) as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise ValueError(f"database {display_url(url)}: {reason}") from None


def with_session(work: Callable[[AsyncSession], Awaitable[T]], settings: Settings | None = None) -> T:
    """Runs `work` in one session on a migrated database."""

    async def run(engine: AsyncEngine) -> T:
        await require_migrated(engine)
        async with session_factory(engine)() as session:
            return await work(session)

    return run_db(run, settings)


async def require_migrated(engine: AsyncEngine) -> None:
    current, head = await current_revision(engine), head_revision()
    if current != head:
        raise ValueError(f"the database schema is at {current or 'nothing'}, not {head}: run `loraplex db upgrade`")


def positive_int(text: str | None, flag: str) -> int | None:
    """Parses a flag's value ourselves, so that a bad one is one `loraplex: error:` line."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag} must be a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {text!r}")
    return value
