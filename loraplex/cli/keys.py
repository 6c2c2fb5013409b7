"""`loraplex keys create|list|revoke`. A new key is printed once, alone on the last line."""

from __future__ import annotations

import argparse
from datetime import timedelta

from loraplex.cli.storage import with_session
from loraplex.cli.table import add_json_flag, print_rows
from loraplex.engine.api import PRIORITY_CLASSES
from loraplex.platform.db.tables import utcnow
from loraplex.platform.tenancy import keys


def add_parser(sub) -> None:
    p = sub.add_parser("keys", help="manage API keys")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    c = ksub.add_parser("create", help="issue a key for a tenant (printed once, on the last line)")
    c.add_argument("--tenant", required=True, help="the tenant the key acts for")
    c.add_argument("--name", help="a label for the key")
    c.add_argument("--expires-in-days", type=float, help="refuse the key after this many days (default: never)")
    c.add_argument("--max-priority", default="standard", choices=PRIORITY_CLASSES,
                   help="the highest priority class its requests may ask for (default standard)")
    c.add_argument("--rpm", type=int, help="requests per minute (default: no limit)")
    c.add_argument("--tpm", type=int, help="tokens per minute (default: no limit)")
    c.add_argument("--model", action="append", dest="models", help="allowed base model (repeatable; default all)")
    c.add_argument("--adapter", action="append", dest="adapters", help="allowed adapter (repeatable; default all)")
    c.set_defaults(func=_create)
    ls = ksub.add_parser("list", help="list a tenant's keys (prefixes only)")
    ls.add_argument("--tenant", required=True, help="whose keys")
    add_json_flag(ls)
    ls.set_defaults(func=_list)
    r = ksub.add_parser("revoke", help="revoke the key with this display prefix")
    r.add_argument("prefix", help="the key's display prefix (its first 12 characters, as `keys list` shows)")
    r.set_defaults(func=_revoke)


def _create(args: argparse.Namespace) -> int:
    if args.expires_in_days is not None and args.expires_in_days <= 0:
        raise ValueError(f"--expires-in-days must be > 0, got {args.expires_in_days}")
    spec = keys.KeySpec(
        name=args.name, max_priority=args.max_priority, rpm_limit=args.rpm, tpm_limit=args.tpm,
        expires_at=utcnow() + timedelta(days=args.expires_in_days) if args.expires_in_days else None,
        allowed_models=tuple(args.models) if args.models else None,
        allowed_adapters=tuple(args.adapters) if args.adapters else None)
    row, secret = with_session(lambda s: keys.create_key(s, args.tenant, spec))
    print(f"created key {row.prefix} for tenant {args.tenant}; it is shown only this once:")
    print(secret)
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = [{"prefix": k.prefix, "name": k.name, "max_priority": k.max_priority,
             "state": "revoked" if k.revoked_at else "active", "expires_at": k.expires_at, "rpm": k.rpm_limit,
             "tpm": k.tpm_limit} for k in with_session(lambda s: keys.list_keys(s, args.tenant))]
    print_rows(args, ("prefix", "name", "max_priority", "state", "expires_at", "rpm", "tpm"), rows)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    row = with_session(lambda s: keys.revoke_key(s, args.prefix))
    print(f"revoked key {row.prefix}")
    return 0
