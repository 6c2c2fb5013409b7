"""`loraplex tenants create|list|update|disable|enable`."""

from __future__ import annotations

import argparse

from loraplex.cli.storage import positive_int, with_session
from loraplex.cli.table import add_json_flag, print_rows
from loraplex.platform.tenancy import tenants


def add_parser(sub) -> None:
    p = sub.add_parser("tenants", help="manage tenants")
    tsub = p.add_subparsers(dest="tenants_command", required=True)
    c = tsub.add_parser("create", help="create a tenant")
    c.add_argument("name", help="the tenant's name (its requests and keys refer to it)")
    c.add_argument("--tier", default="standard",
                   help="a label for your own grouping, e.g. free or gold (default standard)")
    c.add_argument("--default-max-tokens", help="what a request without max_tokens may generate (and reserve)")
    c.set_defaults(func=_create)
    u = tsub.add_parser("update", help="change a tenant's settings")
    u.add_argument("name", help="the tenant to change")
    u.add_argument("--default-max-tokens", required=True, help="a positive integer, or 'none' for the platform default")
    u.set_defaults(func=_update)
    ls = tsub.add_parser("list", help="list tenants")
    add_json_flag(ls)
    ls.set_defaults(func=_list)
    for status, verb, what in (("disabled", "disable", "refuse every key of a tenant until it is enabled again"),
                               ("active", "enable", "let a disabled tenant's keys work again")):
        s = tsub.add_parser(verb, help=what)
        s.add_argument("name", help=f"the tenant to {verb}")
        s.set_defaults(func=_set_status, status=status)


def _create(args: argparse.Namespace) -> int:
    cap = positive_int(args.default_max_tokens, "--default-max-tokens")
    t = with_session(lambda s: tenants.create_tenant(s, args.name, args.tier, cap))
    print(f"created tenant {t.name} (tier {t.tier})")
    return 0


def _update(args: argparse.Namespace) -> int:
    raw = args.default_max_tokens
    cap = None if raw.strip().lower() == "none" else positive_int(raw, "--default-max-tokens")
    t = with_session(lambda s: tenants.set_default_max_tokens(s, args.name, cap))
    print(f"tenant {t.name}: default max_tokens {t.default_max_tokens or 'platform default'}")
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = [{"name": t.name, "tier": t.tier, "status": t.status, "default_max_tokens": t.default_max_tokens,
             "created_at": t.created_at} for t in with_session(tenants.list_tenants)]
    print_rows(args, ("name", "tier", "status", "default_max_tokens", "created_at"), rows)
    return 0


def _set_status(args: argparse.Namespace) -> int:
    t = with_session(lambda s: tenants.set_status(s, args.name, args.status))
    print(f"tenant {t.name} is {t.status}")
    return 0
