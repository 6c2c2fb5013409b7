"""The Alembic migrations: empty -> head -> base on Postgres and on SQLite, and the ORM tables
match what the migrations make."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from loraplex.platform.db.database import make_engine
from loraplex.platform.db.migrate import current_revision, downgrade, head_revision, upgrade
from loraplex.platform.db.provision import create_database, drop_database
from loraplex.platform.db.tables import METADATA
from tests.integration.conftest import PG_SERVER, run

TABLES = {"tenants", "api_keys", "models", "adapters", "budgets", "usage_ledger", "usage_daily", "prices"}


async def _round_trip(url: str) -> dict:
    engine = make_engine(url)
    seen = {}
    try:
        async with engine.connect() as conn:
            seen["empty"] = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
        await upgrade(engine)
        seen["revision"] = await current_revision(engine)
        async with engine.connect() as conn:
            seen["head"] = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
            seen["diff"] = await conn.run_sync(
                lambda c: compare_metadata(MigrationContext.configure(c), list(METADATA)))
        await downgrade(engine, "base")
        seen["base_revision"] = await current_revision(engine)
        async with engine.connect() as conn:
            seen["base"] = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
        await upgrade(engine)  # and up again: downgrade left nothing behind that blocks it
        seen["again"] = await current_revision(engine)
    finally:
        await engine.dispose()
    return seen


@pytest.fixture(params=["postgres", "sqlite"])
def empty_database(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'migrations.db'}"
        return
    url = run(create_database(PG_SERVER, prefix="loraplex_test_migrations_"))
    yield url
    run(drop_database(url))


def test_upgrade_to_head_and_downgrade_to_base(empty_database):
    seen = run(_round_trip(empty_database))
    assert seen["empty"] == set()
    assert seen["head"] >= TABLES and seen["revision"] == head_revision()
    assert seen["diff"] == []
    assert seen["base"] <= {"alembic_version"} and seen["base_revision"] is None
    assert seen["again"] == head_revision()


async def _models_across_0003(url: str) -> dict:
    """A model registered at 0002 keeps its row through 0003 (out of auto's pool) and back."""
    engine = make_engine(url)
    seen = {}
    try:
        await upgrade(engine, "0002")
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO models (name, source, created_at) "
                                    "VALUES ('kept', 'synthetic:tiny', CURRENT_TIMESTAMP)"))
        await upgrade(engine)
        async with engine.connect() as conn:
            seen["after"] = (await conn.execute(text("SELECT name, auto_max_complexity FROM models"))).all()
        for value in (1.5, -0.5):
            try:
                async with engine.begin() as conn:
                    await conn.execute(text("UPDATE models SET auto_max_complexity = :v"), {"v": value})
                seen[value] = "stored"
            except IntegrityError:
                seen[value] = "refused"
        await downgrade(engine, "0002")
        async with engine.connect() as conn:
            seen["down"] = (await conn.execute(text("SELECT name FROM models"))).all()
    finally:
        await engine.dispose()
    return seen


def test_0003_adds_auto_max_complexity_keeping_models(empty_database):
    seen = run(_models_across_0003(empty_database))
    assert seen["after"] == [("kept", None)]
    assert seen[1.5] == seen[-0.5] == "refused"  # the check constraint, on both databases
    assert seen["down"] == [("kept",)]


async def _budgets_across_0005(url: str) -> dict:
    """0005 admits weekly budgets (and still refuses unknown periods and a second tenant budget of one
    period); its downgrade deletes the weekly ones and refuses 'week' again."""
    engine = make_engine(url)
    seen: dict = {}

    async def insert(period: str, tenant: int = 1) -> str:
        try:
            async with engine.begin() as conn:
                await conn.execute(text("INSERT INTO budgets (tenant_id, period, limit_tokens, created_at, updated_at) "
                                        "VALUES (:t, :p, 10, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                                   {"t": tenant, "p": period})
            return "stored"
        except IntegrityError:
            return "refused"

    try:
        await upgrade(engine, "0004")
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO tenants (name, tier, status, created_at) "
                                    "VALUES ('t', 'standard', 'active', CURRENT_TIMESTAMP)"))
        seen["week at 0004"] = await insert("week")
        seen["day at 0004"] = await insert("day")
        await upgrade(engine, "0005")
        seen["week at 0005"] = await insert("week")
        seen["second week"] = await insert("week")  # the partial unique index survived the table's rebuild
        seen["year"] = await insert("year")
        await downgrade(engine, "0004")
        async with engine.connect() as conn:
            seen["kept"] = sorted(r[0] for r in (await conn.execute(text("SELECT period FROM budgets"))).all())
        seen["week after downgrade"] = await insert("week")
    finally:
        await engine.dispose()
    return seen


def test_0005_adds_weekly_budgets_and_its_downgrade_removes_them(empty_database):
    seen = run(_budgets_across_0005(empty_database))
    assert seen == {"week at 0004": "refused", "day at 0004": "stored", "week at 0005": "stored",
                    "second week": "refused", "year": "refused", "kept": ["day"],
                    "week after downgrade": "refused"}
