"""`loraplex budgets set|list|delete`: token budgets of tenants and keys, per day, ISO week, month (UTC) or in total."""

from __future__ import annotations

import argparse

from loraplex.billing.periods import BUDGET_PERIODS
from loraplex.billing.rebuild import tenant_usage
from loraplex.billing.usage import utcnow
from loraplex.cli.storage import positive_int, require_migrated, run_db
from loraplex.cli.table import add_json_flag, print_rows
from loraplex.platform.db.database import session_factory
from loraplex.platform.tenancy import budgets


def add_parser(sub) -> None:
    p = sub.add_parser("budgets", help="token budgets of tenants and keys")
    bsub = p.add_subparsers(dest="budgets_command", required=True)
    s = bsub.add_parser("set", help="create or replace a budget (one per tenant or key and period)")
    s.add_argument("--tenant", required=True, help="the tenant the budget limits (all its keys, or --key's)")
    s.add_argument("--limit-tokens", required=True, help="prompt + completion tokens allowed per period")
    s.add_argument("--period", required=True, help=f"{', '.join(BUDGET_PERIODS)} (UTC; weeks from Monday)")
    s.add_argument("--key", help="the display prefix of one of the tenant's keys (default: the whole tenant)")
    s.add_argument("--soft-limit-tokens", help="raise an alert (metric and log) from this many tokens on")
    s.set_defaults(func=_set)
    ls = bsub.add_parser("list", help="budgets and what the ledger says is used in the current period")
    ls.add_argument("--tenant", help="one tenant's budgets (default: every tenant's)")
    add_json_flag(ls)
    ls.set_defaults(func=_list)
    d = bsub.add_parser("delete", help="remove a budget")
    d.add_argument("--tenant", required=True, help="the budget's tenant")
    d.add_argument("--period", required=True, help="the budget's period, as it was set")
    d.add_argument("--key", help="the key's display prefix, for a key's budget (default: the tenant's own)")
    d.set_defaults(func=_delete)


def _with_usage(work):
    """Runs `work(session)` and returns its budget rows with each one's current-period usage."""

    async def run(engine):
        await require_migrated(engine)
        async with session_factory(engine)() as session:
            rows = await work(session)
        now, used = utcnow(), {}
        for row in rows:
            if row.tenant_id not in used:
                used[row.tenant_id] = (await tenant_usage(engine, row.tenant_id, now, fenced=False))[1]
        return [(row, used[row.tenant_id].get(budgets.rule_of(row).counter(row.key_id, now), 0)) for row in rows]

    return run_db(run)


def _line(row, used: int) -> str:
    soft = row.soft_limit_tokens if row.soft_limit_tokens is not None else "-"
    key = row.key.prefix if row.key else "-"
    return f"{row.tenant.name}\t{key}\t{row.period}\tlimit {row.limit_tokens}\tsoft {soft}\tused {used}"


def _set(args: argparse.Namespace) -> int:
    limit = positive_int(args.limit_tokens, "--limit-tokens")
    soft = positive_int(args.soft_limit_tokens, "--soft-limit-tokens")
    ((row, used),) = _with_usage(lambda s: _one(budgets.set_budget(s, args.tenant, args.period, limit, soft,
                                                                    args.key)))
    print(f"budget set: {_line(row, used)}")
    return 0


async def _one(coro):
    return [await coro]


def _list(args: argparse.Namespace) -> int:
    rows = [{"tenant": row.tenant.name, "key": row.key.prefix if row.key else None, "period": row.period,
             "limit_tokens": row.limit_tokens, "soft_limit_tokens": row.soft_limit_tokens, "used_tokens": used}
            for row, used in _with_usage(lambda s: budgets.list_budgets(s, args.tenant))]
    print_rows(args, ("tenant", "key", "period", "limit_tokens", "soft_limit_tokens", "used_tokens"), rows)
    return 0


def _delete(args: argparse.Namespace) -> int:
    _with_usage(lambda s: _one(budgets.delete_budget(s, args.tenant, args.period, args.key)))
    print(f"budget deleted: {args.tenant} {args.key or '-'} {args.period}")
    return 0
