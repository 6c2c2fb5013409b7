"""`loraplex models list|add|route|score`: the base-model catalog, `auto`'s pool, and the complexity
score `auto` would give a prompt (to choose the pool's limits)."""

from __future__ import annotations

import argparse
import sys

from loraplex.cli.storage import positive_int, with_session
from loraplex.platform import complexity
from loraplex.platform.auto_route import request_text
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
    score = msub.add_parser("score", help="the complexity score `auto` gives a prompt, signal by signal")
    score.add_argument("--prompt", help="the user's message (default: read from stdin)")
    score.add_argument("--max-tokens", metavar="N", help="the request's max_tokens")
    score.set_defaults(func=_score)


def _auto(value: float | None) -> str:
    return "-" if value is None else f"auto<={value:g}"


def _list(args: argparse.Namespace) -> int:
    for m in with_session(catalog.list_models):
        print(f"{m.name}\t{m.source}\t{_auto(m.auto_max_complexity)}")
    return 0


def _add(args: argparse.Namespace) -> int:
    raw = args.auto_max_complexity  # parsed by the catalog, not argparse: a bad value is one error line
    limit = None if raw is None else catalog.parse_max_complexity(raw)
    m = with_session(lambda s: catalog.register_model(s, args.name, args.source, limit))
    print(f"registered model {m.name} ({m.source}, {_auto(m.auto_max_complexity)})")
    return 0


def _route(args: argparse.Namespace) -> int:
    value = None if args.off else catalog.parse_max_complexity(args.max_complexity)
    m = with_session(lambda s: catalog.set_auto_route(s, args.name, value))
    print(f"model {m.name}: {'out of auto' if value is None else f'auto takes up to complexity {value:g}'}"
          " (running servers see it within their catalog cache's TTL)")
    return 0


def _score(args: argparse.Namespace) -> int:
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    scored = complexity.score(request_text({"prompt": text}, positive_int(args.max_tokens, "--max-tokens")))
    print(f"score\t{scored.score:.4f}")
    for name, value in scored.signals.items():
        print(f"{name}\t{value:.2f} x {complexity.WEIGHTS[name]:.2f}")
    return 0
