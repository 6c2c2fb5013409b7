"""Alembic environment: one set of migrations for Postgres (asyncpg) and SQLite (aiosqlite).

`loraplex.platform.db.migrate` hands in an open connection (config.attributes["connection"]);
the `alembic` command line gets its URL from `-x url=...` or the LORAPLEX_* settings.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context

from loraplex.platform.db.tables import METADATA

config = context.config
target_metadata = list(METADATA)


def _url() -> str:
    from loraplex.platform.settings import Settings

    given = context.get_x_argument(as_dictionary=True).get("url")
    if given:
        from loraplex.platform.db.database import async_url

        return async_url(given)
    return Settings.from_env().effective_database_url


def _migrate(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


async def _migrate_url(url: str) -> None:
    from loraplex.platform.db.database import make_engine

    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_migrate)
            await conn.commit()
    finally:
        await engine.dispose()


def main() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    if config.config_file_name is not None:
        fileConfig(config.config_file_name)
    if context.is_offline_mode():
        context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    asyncio.run(_migrate_url(_url()))


main()
