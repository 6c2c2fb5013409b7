"""What the platform's CLI commands share: settings from the environment, one database session
per command, and storage failures as one clear line (`loraplex: error: ...`, exit 2).

- Only `serve` and `db upgrade` create a database (`create=True`); any other command run where there is
  none says so and how to point at one, instead of making an empty one under ./.loraplex/.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from loraplex.platform.db.database import display_url, is_sqlite, make_engine, session_factory
from loraplex.platform.db.migrate import current_revision, head_revision
from loraplex.platform.settings import Settings

T = TypeVar("T")


POINT_AT_ONE = ("set LORAPLEX_DATABASE_URL (or LORAPLEX_DATA_DIR) to the server's, run this from the directory "
                "where `make serve` or `loraplex serve` runs, or run `loraplex db upgrade` to create a new one")


def missing_sqlite_file(url: str) -> Path | None:
    """The SQLite file `url` names when it does not exist (None: it does, or it is not SQLite)."""
    if not is_sqlite(url):
        return None
    database = make_url(url).database
    if not database or database == ":memory:" or Path(database).exists():
        return None
    return Path(database).absolute()


def run_db(work: Callable[[AsyncEngine], Awaitable[T]], settings: Settings | None = None, *,
           create: bool = False) -> T:
    """Runs `work` on an engine for the configured database; connection problems become ValueError.
    Without `create`, a SQLite file that does not exist is an error (opening it would create it)."""
    settings = settings or Settings.from_env()
    url = settings.effective_database_url
    missing = None if create else missing_sqlite_file(url)
    if missing is not None:
        raise ValueError(f"no database found at {missing}: {POINT_AT_ONE}")

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
        hint = f": {POINT_AT_ONE}" if "does not exist" in reason else ""
        raise ValueError(f"database {display_url(url)}: {reason}{hint}") from None


def with_session(work: Callable[[AsyncSession], Awaitable[T]], settings: Settings | None = None) -> T:
    """Runs `work` in one session on a migrated database."""

    async def run(engine: AsyncEngine) -> T:
        await require_migrated(engine)
        async with session_factory(engine)() as session:
            return await work(session)

    return run_db(run, settings)


async def require_migrated(engine: AsyncEngine) -> None:
    current, head = await current_revision(engine), head_revision()
    if current is None:
        raise ValueError(f"the database {display_url(engine.url.render_as_string())} has no loraplex tables: "
                         f"{POINT_AT_ONE}")
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
