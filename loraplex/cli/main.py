"""The `loraplex` command: one sub-command per job, each in its own module."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from loraplex.cli import (
    adapters,
    bench_cmd,
    billing,
    budgets,
    db,
    doctor,
    generate,
    keys,
    models,
    prices,
    router,
    serve,
    tenants,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA and multi-model LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    bench_cmd.add_parser(sub)
    serve.add_parser(sub)
    db.add_parser(sub)
    doctor.add_parser(sub)
    tenants.add_parser(sub)
    keys.add_parser(sub)
    models.add_parser(sub)
    adapters.add_parser(sub)
    budgets.add_parser(sub)
    prices.add_parser(sub)
    billing.add_parser(sub)
    router.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one command. Errors the user can fix (bad input, a missing file, a refusal) are one line,
    exit 2; anything else is a bug: one line saying so, exit 1. LORAPLEX_DEBUG=1 adds the traceback."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from loraplex.engine.api import EngineError

        if os.environ.get("LORAPLEX_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        if isinstance(exc, EngineError | ValueError | OSError):
            print(f"loraplex: error: {exc}", file=sys.stderr)
            return 2
        print(f"loraplex: internal error: {type(exc).__name__}: {exc} (set LORAPLEX_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
