"""`loraplex prices set|list`: prices per 1M input, cached input and output tokens of a model."""

from __future__ import annotations

import argparse
from datetime import datetime

from loraplex.billing.prices import PriceSpec, list_prices
from loraplex.cli.storage import with_session
from loraplex.cli.table import add_json_flag, print_rows
from loraplex.platform.tenancy.prices import set_price


def add_parser(sub) -> None:
    p = sub.add_parser("prices", help="model prices (per 1M tokens) used to cost the usage ledger")
    psub = p.add_subparsers(dest="prices_command", required=True)
    s = psub.add_parser("set", help="add a price for a model from a time on (prices never change the past)")
    s.add_argument("--model", required=True, help="a registered base model (or an adapter's base model)")
    s.add_argument("--input-per-1m", required=True, help="per 1M uncached prompt tokens, e.g. 0.15")
    s.add_argument("--cached-input-per-1m", required=True, help="per 1M prompt tokens served from the cache")
    s.add_argument("--output-per-1m", required=True, help="per 1M completion tokens")
    s.add_argument("--currency", default="USD", help="a three-letter code (default USD)")
    s.add_argument("--effective-from", help="ISO-8601 time (UTC unless it says otherwise); default now")
    s.set_defaults(func=_set)
    ls = psub.add_parser("list", help="every price, oldest first")
    ls.add_argument("--model", help="one model's prices (default: every model's)")
    add_json_flag(ls)
    ls.set_defaults(func=_list)


def _when(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--effective-from must be an ISO-8601 time such as 2026-11-01T00:00:00Z, got {text!r}") \
            from None


PRICE_COLUMNS = ("model", "currency", "input_per_1m", "cached_input_per_1m", "output_per_1m", "effective_from")


def _print(price) -> None:
    p = price.as_json()
    print(f"{p['model']}\t{p['currency']}\tinput {p['input_per_1m']}\tcached {p['cached_input_per_1m']}\t"
          f"output {p['output_per_1m']}\tfrom {p['effective_from']}")


def _set(args: argparse.Namespace) -> int:
    spec = PriceSpec(args.model, args.input_per_1m, args.cached_input_per_1m, args.output_per_1m, args.currency,
                     _when(args.effective_from))
    price = with_session(lambda s: set_price(s, spec))
    print("price set: ", end="")
    _print(price)
    return 0


def _list(args: argparse.Namespace) -> int:
    print_rows(args, PRICE_COLUMNS, [p.as_json() for p in with_session(lambda s: list_prices(s, args.model))])
    return 0
