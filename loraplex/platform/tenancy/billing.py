"""What billing needs from the tenancy side: names for the ledger's ids, and a period's export
checked (period, format, tenant) before the first byte is produced, for the admin API and the CLI."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from loraplex.billing.export_format import FORMATS, ExportError, check_format, export
from loraplex.billing.exports import Directory
from loraplex.billing.periods import DateRange, PeriodError, parse_period
from loraplex.platform.db.tables import ApiKey, Tenant
from loraplex.platform.errors import invalid
from loraplex.platform.tenancy.tenants import get_tenant


async def load_directory(session: AsyncSession) -> Directory:
    tenants = dict((await session.execute(select(Tenant.id, Tenant.name))).all())
    keys = dict((await session.execute(select(ApiKey.id, ApiKey.prefix))).all())
    return Directory(tenants, keys)


@dataclass(frozen=True)
class ExportRequest:
    period: DateRange
    format: str
    detail: bool
    tenant: str | None
    tenant_id: int | None
    names: Directory

    @property
    def media_type(self) -> str:
        return FORMATS[self.format]

    @property
    def filename(self) -> str:
        kind = "requests" if self.detail else "invoice"
        span = self.period.start.isoformat() + (f"_{self.period.last_day.isoformat()}"
                                                if self.period.last_day != self.period.start else "")
        return f"loraplex-{kind}-{span}-{self.tenant or 'all'}.{self.format}"

    def stream(self, db: AsyncEngine) -> AsyncIterator[bytes]:
        return export(db, self.period, self.format, self.names, detail=self.detail, tenant_id=self.tenant_id)


async def prepare_export(session: AsyncSession, period: str, fmt: str, detail: bool = False,
                         tenant: str | None = None) -> ExportRequest:
    """Validates everything first: a bad request fails before any output exists."""
    try:
        span = parse_period(period)
        check_format(fmt)
    except (PeriodError, ExportError) as exc:
        raise invalid(str(exc), exc.param) from None
    tenant_id = (await get_tenant(session, tenant)).id if tenant else None
    return ExportRequest(span, fmt, detail, tenant, tenant_id, await load_directory(session))
