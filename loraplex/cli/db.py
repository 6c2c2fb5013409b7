"""`loraplex db upgrade|downgrade|current`: the Alembic migrations on the configured database."""

from __future__ import annotations

import argparse

from loraplex.cli.storage import run_db
from loraplex.platform.db.database import display_url
from loraplex.platform.db.migrate import current_revision, downgrade, upgrade
from loraplex.platform.settings import Settings


def add_parser(sub) -> None:
    p = sub.add_parser("db", help="database schema migrations (LORAPLEX_DATABASE_URL, default: embedded SQLite)")
    dsub = p.add_subparsers(dest="db_command", required=True)
    up = dsub.add_parser("upgrade", help="migrate to the newest schema (or --revision)")
    up.add_argument("--revision", default="head", help="the revision to reach (default head, the newest)")
    up.set_defaults(func=_upgrade)
    down = dsub.add_parser("downgrade", help="migrate back to REVISION ('base' drops every table)")
    down.add_argument("revision", help="the revision to go back to, or 'base' (nothing)")
    down.set_defaults(func=_downgrade)
    cur = dsub.add_parser("current", help="print the schema revision")
    cur.set_defaults(func=_current)


def _migrate(step, revision: str, create: bool = False) -> int:
    settings = Settings.from_env()

    async def work(engine) -> str | None:
        await step(engine, revision)
        return await current_revision(engine)

    now = run_db(work, settings, create=create)
    print(f"database {display_url(settings.effective_database_url)} at revision {now or 'base'}")
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    return _migrate(upgrade, args.revision, create=True)


def _downgrade(args: argparse.Namespace) -> int:
    return _migrate(downgrade, args.revision)


def _current(args: argparse.Namespace) -> int:
    print(run_db(current_revision) or "base")
    return 0
