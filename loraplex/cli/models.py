"""`loraplex models list|add`: the base-model catalog."""

from __future__ import annotations

import argparse

from loraplex.cli.storage import with_session
from loraplex.platform.tenancy import catalog


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="the base-model catalog")
    msub = p.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="list registered base models")
    ls.set_defaults(func=_list)
    add = msub.add_parser("add", help="register a base model")
    add.add_argument("name")
    add.add_argument("--source", help="what the engine loads (default: the name)")
    add.set_defaults(func=_add)


def _list(args: argparse.Namespace) -> int:
    for m in with_session(catalog.list_models):
        print(f"{m.name}\t{m.source}")
    return 0


def _add(args: argparse.Namespace) -> int:
    m = with_session(lambda s: catalog.register_model(s, args.name, args.source))
    print(f"registered model {m.name} ({m.source})")
    return 0
