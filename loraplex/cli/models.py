"""`loraplex models list|add|route|score|calibrate`: the base-model catalog, `auto`'s pool, the score
`auto` would give a request (one, with what drove it, or a JSON-lines file of them), and setting the
pool's limits for a share of traffic."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loraplex.cli.storage import positive_int, with_session
from loraplex.cli.table import add_json_flag, print_rows
from loraplex.platform.routing import complexity
from loraplex.platform.routing.learned import calibration
from loraplex.platform.routing.learned.requests import read_requests, request_text
from loraplex.platform.routing.learned.scorer import HeuristicScorer, Scorer, load_scorer
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy import catalog


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="the base-model catalog")
    msub = p.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="list registered base models (name, source, auto_max_complexity)")
    add_json_flag(ls)
    ls.set_defaults(func=_list)
    add = msub.add_parser("add", help="register a base model")
    add.add_argument("name", help="what requests call it (`model`)")
    add.add_argument("--source", help="what the engine loads (default: the name)")
    add.add_argument("--auto-max-complexity", metavar="X",
                     help="put it in `auto`'s pool for requests of complexity up to X (0-1)")
    add.set_defaults(func=_add)
    route = msub.add_parser("route", help="put a model in `auto`'s pool, or take it out")
    route.add_argument("name", help="a registered model")
    which = route.add_mutually_exclusive_group(required=True)
    which.add_argument("--max-complexity", metavar="X",
                       help="`auto` may send it requests of complexity up to X (0-1)")
    which.add_argument("--off", action="store_true", help="`auto` never chooses it")
    route.set_defaults(func=_route)
    score = msub.add_parser("score", help="the score `auto` gives a prompt and what drove it; or, with --input, "
                                          "one JSON line with the score of each request of a JSON-lines file")
    score.add_argument("--prompt", help="the user's message (default: read from stdin)")
    score.add_argument("--max-tokens", metavar="N", help="the request's max_tokens")
    score.add_argument("--input", metavar="FILE",
                       help="JSON lines ({\"prompt\"} or {\"messages\"}, optional max_tokens; '-': stdin): "
                            "prints {\"score\"} per line, in order")
    score.add_argument("--router", choices=["learned", "heuristic"], help="the scorer (default: LORAPLEX_ROUTER, "
                                                                          "else learned)")
    score.add_argument("--router-weights", metavar="PATH", help="learned weights (default: LORAPLEX_ROUTER_WEIGHTS, "
                                                                "else the shipped ones)")
    score.set_defaults(func=_score)
    cal = msub.add_parser("calibrate", help="set auto's limits so that a share of the traffic recorded in a "
                                            "window goes to the most capable model (or shares per model)")
    share = cal.add_mutually_exclusive_group(required=True)
    share.add_argument("--strong-share", type=float, metavar="X",
                       help="share (0-1) for the most capable model; the others split the rest evenly")
    share.add_argument("--shares", metavar="NAME=X,...", help="a share for every model of the pool, summing to 1")
    cal.add_argument("--since", default="7d", help="the window of recorded scores (e.g. 7d, 24h; default 7d)")
    cal.add_argument("--dry-run", action="store_true", help="print the limits, do not set them")
    cal.set_defaults(func=_calibrate)


def _auto(value: float | None) -> str:
    return "-" if value is None else f"auto<={value:g}"


def _list(args: argparse.Namespace) -> int:
    rows = [{"name": m.name, "source": m.source, "auto_max_complexity": m.auto_max_complexity}
            for m in with_session(catalog.list_models)]
    print_rows(args, ("name", "source", "auto_max_complexity"), rows)
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


def _scorer(args: argparse.Namespace) -> Scorer:
    settings = Settings.from_env()
    weights = Path(args.router_weights) if args.router_weights else settings.router_weights
    return load_scorer(args.router or ("learned" if args.router_weights else settings.router), weights)


def _score(args: argparse.Namespace) -> int:
    scorer = _scorer(args)
    if args.input is not None:
        return _score_lines(scorer, args.input)
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    req = request_text({"prompt": text}, positive_int(args.max_tokens, "--max-tokens"))
    if isinstance(scorer, HeuristicScorer):
        scored = complexity.score(req)
        print(f"score\t{scored.score:.4f}")
        for name, value in scored.signals.items():
            print(f"{name}\t{value:.2f} x {complexity.WEIGHTS[name]:.2f}")
        return 0
    explained = scorer.explain(req)
    print(f"score\t{explained.score:.4f}")
    print("# what moved it (contribution to the log-odds that the strong model is needed):")
    for driver in explained.drivers:
        print(f"{driver.name}\t{driver.contribution:+.3f}")
    return 0


def _score_lines(scorer: Scorer, path: str) -> int:
    """One {"score"} line per request, flushed as it goes; a bad line stops with its number."""
    stream = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115 (closed below)
    try:
        for req in read_requests(stream):
            sys.stdout.write(json.dumps({"score": scorer.score(req)}) + "\n")
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()
        sys.stdout.flush()
    return 0


def _parse_shares(raw: str) -> dict[str, float]:
    out = {}
    for part in raw.split(","):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--shares must be NAME=X,... with X from 0 to 1, got {raw!r}") from None
    return out


def _calibrate(args: argparse.Namespace) -> int:
    window = calibration.parse_window(args.since)
    shares = _parse_shares(args.shares) if args.shares else None
    result = with_session(lambda s: calibration.calibrate_pool(s, window, args.strong_share, shares,
                                                               apply=not args.dry_run))
    verb = "would set" if args.dry_run else "set"
    print(f"{result.scores} scores since {args.since}; {verb} (running servers see it within their catalog "
          "cache's TTL):")
    for name, limit in result.thresholds.items():
        print(f"{name}\tauto<={limit:g}\tshare {result.shares[name]:.3f} asked, "
              f"{result.expected[name]:.3f} on the window's scores")
    return 0
