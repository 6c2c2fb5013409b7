"""How list commands print: an aligned table under a header line, or with `--json` one JSON array of
objects (one per row, keyed by the column names) for scripts."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

JSON_HELP = "print one JSON array of objects, one per row, keyed by the column names (for scripts)"


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _plain(value):
    """A value as JSON holds it (times as ISO-8601)."""
    return value.isoformat() if isinstance(value, datetime) else value


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return f"{value:%Y-%m-%d %H:%M}"
    return str(value)


def format_table(columns: Sequence[str], rows: Iterable[Mapping]) -> str:
    """Columns left-aligned to their widest cell, two spaces apart, under an upper-case header
    (`_` in a column name becomes a space); missing values show as `-`."""
    header = [c.replace("_", " ").upper() for c in columns]
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(columns))]
    return "\n".join("  ".join(text.ljust(w) for text, w in zip(line, widths, strict=True)).rstrip()
                     for line in [header, *cells])


def print_rows(args: argparse.Namespace, columns: Sequence[str], rows: Iterable[Mapping]) -> None:
    """The rows as a table, or as JSON when the command was given `--json`."""
    rows = list(rows)
    if getattr(args, "json", False):
        print(json.dumps([{c: _plain(row.get(c)) for c in columns} for row in rows], indent=None))
    else:
        print(format_table(columns, rows))
