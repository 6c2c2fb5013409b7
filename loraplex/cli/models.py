"""`loraplex models list|add|route`: the base-model catalog and `auto`'s pool."""

from __future__ import annotations

import argparse

from loraplex.cli.storage import with_session
from loraplex.platform.tenancy import catalog


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="the base-model catalog")
    msub = p.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="list registered base models (name, source, auto_max_complexity)")
    ls.set_defaults(func=_list)
    add = msub.add_parser("add", help="register a base model")
    add.add_argument("name")
    add.add_argument("--source", help="what the engine loads (default: the name)")
    add.add_argument("--auto-max-complexity", metavar="X",
                     help="put it in `auto`'s pool for requests of complexity up to X (0-1)")
    add.set_defaults(func=_add)
    route = msub.add_parser("route", help="put a model in `auto`'s pool, or take it out")
    route.add_argument("name")
    which = route.add_mutually_exclusive_group(required=True)
    which.add_argument("--max-complexity", metavar="X",
                       help="`auto` may send it requests of complexity up to X (0-1)")
    which.add_argument("--off", action="store_true", help="`auto` never chooses it")
    route.set_defaults(func=_route)


def _complexity(text: str | None, flag: str) -> float | None:
    """Parsed here, not by argparse, so a bad value is one `loraplex: error:` line (the range is the
    catalog's check)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} must be a number from 0 to 1, got {text!r}") from None


def _auto(value: float | None) -> str:
    return "-" if value is None else f"auto<={value:g}"


def _list(args: argparse.Namespace) -> int:
    for m in with_session(catalog.list_models):
        print(f"{m.name}\t{m.source}\t{_auto(m.auto_max_complexity)}")
    return 0


def _add(args: argparse.Namespace) -> int:
    limit = _complexity(args.auto_max_complexity, "--auto-max-complexity")
    m = with_session(lambda s: catalog.register_model(s, args.name, args.source, limit))
    print(f"registered model {m.name} ({m.source}, {_auto(m.auto_max_complexity)})")
    return 0


def _route(args: argparse.Namespace) -> int:
    value = None if args.off else _complexity(args.max_complexity, "--max-complexity")
    m = with_session(lambda s: catalog.set_auto_route(s, args.name, value))
    print(f"model {m.name}: {'out of auto' if value is None else f'auto takes up to complexity {value:g}'}"
          " (running servers see it within their catalog cache's TTL)")
    return 0
