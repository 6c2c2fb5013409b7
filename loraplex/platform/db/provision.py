"""Scratch Postgres databases: created for one test run or benchmark, dropped after it."""

from __future__ import annotations

import secrets

from sqlalchemy import text
from sqlalchemy.engine import make_url

from loraplex.platform.db.database import async_url, make_engine


def _admin_engine(server_url: str):
    url = make_url(async_url(server_url)).set(database="postgres")
    return make_engine(url.render_as_string(hide_password=False)).execution_options(isolation_level="AUTOCOMMIT")


async def create_database(server_url: str, prefix: str = "loraplex_test_") -> str:
    """Creates `<prefix><random>` on the server of `server_url` (as its user) and returns its URL."""
    name = f"{prefix}{secrets.token_hex(6)}"
    await _admin_execute(server_url, f'CREATE DATABASE "{name}"')
    return make_url(async_url(server_url)).set(database=name).render_as_string(hide_password=False)


async def drop_database(url: str) -> None:
    name = make_url(url).database
    await _admin_execute(url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _admin_execute(url: str, sql: str) -> None:
    """Runs one statement on the server's maintenance database (outside a transaction)."""
    engine = _admin_engine(url)
    try:
        async with engine.connect() as conn:
            await conn.execute(text(sql))
    finally:
        await engine.dispose()
