"""Billing exports as bytes: CSV (a header, then one row per record) or JSON Lines (one object per
record, keys in the same order). Same records in, same bytes out: no clocks, no locale, no
float formatting, "\\n" line ends; money is decimal text, counts are integers.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator, Iterable

from sqlalchemy.ext.asyncio import AsyncEngine

from loraplex.billing.exports import DETAIL_FIELDS, INVOICE_FIELDS, Directory, invoice_lines, request_records
from loraplex.billing.periods import DateRange

FORMATS = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson"}
_CHUNK = 500  # records per yielded piece


class ExportError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}", "format")
    return fmt


class _Renderer:
    def __init__(self, fields: tuple[str, ...], fmt: str):
        self.fields, self.fmt = fields, fmt

    def header(self) -> str:
        return self.rows([dict(zip(self.fields, self.fields, strict=True))]) if self.fmt == "csv" else ""

    def rows(self, records: Iterable[dict]) -> str:
        if self.fmt == "jsonl":
            return "".join(json.dumps({f: r[f] for f in self.fields}, ensure_ascii=False, separators=(",", ":"))
                           + "\n" for r in records)
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for r in records:
            writer.writerow(["" if r[f] is None else r[f] for f in self.fields])
        return out.getvalue()


async def _render(records: AsyncIterator[dict], fields: tuple[str, ...], fmt: str) -> AsyncIterator[bytes]:
    renderer = _Renderer(fields, fmt)
    pending: list[dict] = []
    head = renderer.header()
    if head:
        yield head.encode()
    async for record in records:
        pending.append(record)
        if len(pending) >= _CHUNK:
            yield renderer.rows(pending).encode()
            pending.clear()
    if pending:
        yield renderer.rows(pending).encode()


async def export(db: AsyncEngine, period: DateRange, fmt: str, names: Directory, *, detail: bool = False,
                 tenant_id: int | None = None) -> AsyncIterator[bytes]:
    """The export as pieces of bytes; one database connection, held until the last piece."""
    check_format(fmt)
    async with db.connect() as conn:
        if detail:
            records, fields = request_records(conn, period, names, tenant_id), DETAIL_FIELDS
        else:
            records, fields = _iterate(await invoice_lines(conn, period, names, tenant_id)), INVOICE_FIELDS
        async for piece in _render(records, fields, fmt):
            yield piece


async def _iterate(items: list[dict]) -> AsyncIterator[dict]:
    for item in items:
        yield item
