"""The `loraplex` command: one sub-command per job, each in its own module."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

# Sub-commands in `loraplex --help` order: name -> the module that declares (add_parser) and runs it. A command
# line that names one imports only its module, so `loraplex keys list` does not pay for the engine's, the
# server's and the benchmarks' imports (seconds, most of a short command's time).
COMMANDS = {"generate": "generate", "bench": "bench_cmd", "serve": "serve", "db": "db", "doctor": "doctor",
            "tenants": "tenants", "keys": "keys", "models": "models", "adapters": "adapters", "budgets": "budgets",
            "prices": "prices", "billing": "billing", "router": "router"}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command; of the named one only when argv starts with a sub-command's name."""
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA and multi-model LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    names = [argv[0]] if argv and argv[0] in COMMANDS else list(COMMANDS)
    for name in names:
        importlib.import_module(f"loraplex.cli.{COMMANDS[name]}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one command. Errors the user can fix (bad input, a missing file, a refusal) are one line,
    exit 2; anything else is a bug: one line saying so, exit 1. LORAPLEX_DEBUG=1 adds the traceback."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
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
