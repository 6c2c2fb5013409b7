"""`loraplex router train`: fit `auto`'s learned scorer on labelled requests and write its weights
(serve them with `loraplex serve --router-weights PATH` or LORAPLEX_ROUTER_WEIGHTS)."""

from __future__ import annotations

import argparse
from pathlib import Path

from loraplex.platform.routing.learned import training


def add_parser(sub) -> None:
    p = sub.add_parser("router", help="`auto`'s learned scorer")
    rsub = p.add_subparsers(dest="router_command", required=True)
    train = rsub.add_parser("train", help="fit the scorer on a JSON-lines file of labelled requests "
                                          "(prompt or messages, weak_correct, strong_correct)")
    train.add_argument("--data", required=True, help="JSON lines: {prompt|messages, weak_correct, strong_correct}")
    train.add_argument("--out", required=True, help="where to write the weights (.npz)")
    train.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    with open(args.data, "rb") as stream:
        examples = training.read_examples(stream)
    scorer = training.train(examples, source=Path(args.data).name)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scorer.save(out)
    print(f"trained on {len(examples)} examples; weights in {out} ({out.stat().st_size} bytes)")
    return 0
