"""Runs the Alembic migrations in migrations/ on an open async engine (no alembic.ini needed).

The migrations live at the repository root (migrations/); this finds them next to
the `loraplex` package of a source checkout or an editable install.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS_DIR = Path(__file__).resolve().parents[3] / "migrations"


def alembic_config() -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(f"Alembic migrations not found at {MIGRATIONS_DIR}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Upgrades in one transaction: on Postgres a failed migration leaves nothing behind."""
    await _run(engine, command.upgrade, revision)


async def downgrade(engine: AsyncEngine, revision: str = "base") -> None:
    await _run(engine, command.downgrade, revision)


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())


async def _run(engine: AsyncEngine, step, revision: str) -> None:
    def run(sync_conn) -> None:
        cfg = alembic_config()
        cfg.attributes["connection"] = sync_conn
        step(cfg, revision)

    async with engine.begin() as conn:
        await conn.run_sync(run)
