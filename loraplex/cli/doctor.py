"""`loraplex doctor`: what `serve` would run here and with what, each line a check.

- Compute: the C kernels or the torch fallback and why, the instruction sets, threads, default dtypes.
- Storage: the database URL, whether it answers and its schema's revision; Redis, or that it is not used.
- Exit status 1 when something required is broken (a database or Redis that does not answer, a schema
  this code does not know); the torch fallback and a database not made yet are warnings (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

from loraplex.cli.storage import missing_sqlite_file, run_db
from loraplex.cli.table import add_json_flag, print_rows
from loraplex.platform.db.database import display_url
from loraplex.platform.db.migrate import current_revision, head_revision
from loraplex.platform.settings import Settings

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    check: str
    status: str
    detail: str


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="say what `serve` would run here (C kernels or torch and why, instruction "
                                      "sets, threads, dtypes, database, Redis); exit 1 if something required is "
                                      "broken")
    p.add_argument("--device", default="auto", help="the device to describe: auto (default), cpu, cuda or cuda:N")
    add_json_flag(p)
    p.set_defaults(func=run)


def compute_checks(device: str) -> list[Check]:
    from loraplex.engine.compute import local_compute_path

    path = local_compute_path(device)
    what = {"c": "C kernels", "torch": "torch ops (fallback, slower)", "cuda": "CUDA"}[path.ops]
    return [
        Check("compute", WARN if path.ops == "torch" else OK, f"{what} on {path.device}: {path.reason}"),
        Check("instruction sets", OK, (", ".join(path.instruction_sets) or "no vector extensions")
              + (" (the kernels' build)" if path.instruction_sets_of == "build" else " (the CPU's)")),
        Check("threads", OK, str(path.threads)),
        Check("model dtype", OK, f"{path.model_dtype} (--dtype)"),
        Check("weights", OK, f"{path.weight_dtype} (--weight-dtype)"),
        Check("kv cache dtype", OK, f"{path.kv_cache_dtype} (--kv-cache-dtype, --kv-cache-smoothing)"),
        Check("activation dtype", OK, f"{path.activation_dtype} (--activation-dtype)"),
    ]


def database_check(settings: Settings) -> Check:
    url = settings.effective_database_url
    shown = display_url(url)
    missing = missing_sqlite_file(url)
    if missing is not None:
        return Check("database", WARN, f"no database yet at {missing}; `loraplex serve` or `loraplex db upgrade` "
                                       "creates it (LORAPLEX_DATABASE_URL or LORAPLEX_DATA_DIR points elsewhere)")
    try:
        head = head_revision()
        current = run_db(current_revision, settings)
    except (ValueError, OSError) as exc:
        return Check("database", FAIL, f"{shown}: {exc}")
    if current == head:
        return Check("database", OK, f"{shown}, schema at {head} (the newest)")
    if current is None:
        return Check("database", WARN, f"{shown} answers but has no loraplex tables; `loraplex serve` or "
                                       "`loraplex db upgrade` creates them")
    try:
        from alembic.script import ScriptDirectory

        from loraplex.platform.db.migrate import alembic_config

        ScriptDirectory.from_config(alembic_config()).get_revision(current)
    except Exception:
        return Check("database", FAIL, f"{shown}: schema at {current}, which this version does not know "
                                       f"(newest here: {head}); is the server newer than this code?")
    return Check("database", WARN, f"{shown}: schema at {current}, not {head}; `loraplex serve` upgrades it at "
                                   "start, other commands need `loraplex db upgrade`")


def redis_check(settings: Settings) -> Check:
    if not settings.redis_url:
        return Check("redis", OK, "not used: rate limits and budgets count in this process (one instance only; "
                                  "LORAPLEX_REDIS_URL shares them)")
    import redis.asyncio as redis

    async def ping() -> None:
        client = redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            await client.ping()
        finally:
            await client.aclose()

    shown = display_url(settings.redis_url)
    try:
        asyncio.run(ping())
    except Exception as exc:  # any failure to answer is the finding itself
        return Check("redis", FAIL, f"{shown} does not answer: {str(exc).splitlines()[0] if str(exc) else exc!r}")
    return Check("redis", OK, f"{shown} answers")


def run(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    checks = [*compute_checks(args.device), database_check(settings), redis_check(settings)]
    print_rows(args, ("check", "status", "detail"), (vars(c) for c in checks))
    return 1 if any(c.status == FAIL for c in checks) else 0
