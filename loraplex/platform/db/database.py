"""Async database engines for Postgres (asyncpg) and SQLite (aiosqlite).

Postgres connections time out: opening one after `connect_timeout_s` (asyncpg's own default is
60 s, so a database behind a network that drops packets held every request that needed a new
connection for a minute), and any statement after `command_timeout_s` (asyncpg has none: a
statement on a connection whose packets vanish waited for the kernel to give up, many minutes).
The key and catalog caches wait even less before serving what they hold (outage.py).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

_ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg", "sqlite": "sqlite+aiosqlite"}


def async_url(url: str) -> str:
    """Fills in the async driver: postgresql://... -> postgresql+asyncpg://..., sqlite:// -> aiosqlite."""
    parsed = make_url(url)
    driver = _ASYNC_DRIVERS.get(parsed.drivername)
    if driver is None and parsed.drivername not in _ASYNC_DRIVERS.values():
        raise ValueError(f"database URL must be postgresql:// or sqlite://, got {parsed.drivername}://")
    return parsed.set(drivername=driver).render_as_string(hide_password=False) if driver else url


def display_url(url: str) -> str:
    """The URL with its password hidden, for messages and logs."""
    return make_url(url).render_as_string(hide_password=True)


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


DEFAULT_CONNECT_TIMEOUT_S = 2.0
DEFAULT_COMMAND_TIMEOUT_S = 30.0


def make_engine(url: str, *, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                command_timeout_s: float | None = DEFAULT_COMMAND_TIMEOUT_S) -> AsyncEngine:
    """`command_timeout_s` None or 0: statements never time out."""
    url = async_url(url)
    if is_sqlite(url):
        database = make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, connect_args={"timeout": 30})
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    connect_args = {"timeout": connect_timeout_s, "command_timeout": command_timeout_s or None}
    return create_async_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True, connect_args=connect_args)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    """Foreign keys on (SQLite's default is off) and WAL, so readers never wait for the writer."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
