"""`loraplex billing export`: a period's invoice lines (or, with --detail, every request) as CSV or
JSON Lines, to stdout or to a file. The file is written aside and renamed into place only when
complete, so a failed export leaves nothing half-written."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from loraplex.cli.storage import require_migrated, run_db
from loraplex.platform.db.database import session_factory
from loraplex.platform.tenancy.billing import prepare_export


def add_parser(sub) -> None:
    p = sub.add_parser("billing", help="billing exports from the usage ledger")
    bsub = p.add_subparsers(dest="billing_command", required=True)
    e = bsub.add_parser("export", help="invoice lines per tenant, model, adapter and price (or every request)")
    e.add_argument("--period", required=True, help="YYYY-MM, YYYY-MM-DD or YYYY-MM-DD..YYYY-MM-DD (UTC, inclusive)")
    e.add_argument("--format", default="csv", help="csv (default) or jsonl")
    e.add_argument("--tenant", help="one tenant (default: all)")
    e.add_argument("--detail", action="store_true", help="one record per request instead of invoice lines")
    e.add_argument("--output", help="a file to write (default: stdout)")
    e.set_defaults(func=_export)


def _target(output: str | None) -> Path | None:
    if output is None:
        return None
    path = Path(output)
    if not path.parent.is_dir():
        raise ValueError(f"--output: directory {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"--output: {output!r} is a directory")
    return path


class _Stdout:
    """Bytes to stdout (its binary buffer when it has one: the export is UTF-8 whatever the locale)."""

    def write(self, piece: bytes) -> None:
        buffer = getattr(sys.stdout, "buffer", None)
        if buffer is None:
            sys.stdout.write(piece.decode())
        else:
            buffer.write(piece)

    def flush(self) -> None:
        sys.stdout.flush()


def _export(args: argparse.Namespace) -> int:
    path = _target(args.output)
    part = path.with_name(f".{path.name}.part") if path else None

    async def work(engine) -> int:
        await require_migrated(engine)
        async with session_factory(engine)() as session:
            job = await prepare_export(session, args.period, args.format, args.detail, args.tenant)
        size = 0
        with open(part, "wb") if part else contextlib.nullcontext(_Stdout()) as out:
            async for piece in job.stream(engine):
                out.write(piece)
                size += len(piece)
            out.flush()
            if part:
                os.fsync(out.fileno())
        return size

    try:
        size = run_db(work)
    except BaseException:
        if part:
            part.unlink(missing_ok=True)
        raise
    if path:
        os.replace(part, path)
        print(f"wrote {size} bytes to {path}", file=sys.stderr)
    return 0
