"""GET /v1/usage?period=...: a tenant reads its own usage and cost for a period (the current month
by default), from the same rollups as the invoice export, and where its budgets stand."""

from __future__ import annotations

from litestar import Request, get
from litestar.params import FromQuery

from loraplex.billing.exports import Directory, invoice_lines
from loraplex.billing.periods import PeriodError, current_month, parse_period
from loraplex.billing.rebuild import tenant_usage
from loraplex.billing.usage import utcnow
from loraplex.platform.auth import caller_of
from loraplex.platform.errors import invalid
from loraplex.platform.state import PlatformDep

_HIDDEN = ("record", "tenant", "period_start", "period_end")
_TOTAL_FIELDS = ("currency", "requests", "input_tokens", "cached_input_tokens", "output_tokens", "amount")


@get("/usage", summary="The caller's tenant's usage and cost for a period, and its budgets")
async def usage(request: Request, platform: PlatformDep, period: FromQuery[str | None] = None) -> dict:
    principal = caller_of(request).principal
    now = utcnow()
    try:
        span = parse_period(period) if period else current_month(now)
    except PeriodError as exc:
        raise invalid(str(exc), "period") from None
    async with platform.db.connect() as conn:
        records = await invoice_lines(conn, span, Directory({principal.tenant_id: principal.tenant}),
                                      principal.tenant_id)
    _, used = await tenant_usage(platform.db, principal.tenant_id, now, fenced=False)
    budgets = [{"scope": r.scope, "key": principal.key_prefix if r.scope == "key" else None, "period": r.period,
                "limit_tokens": r.limit_tokens, "soft_limit_tokens": r.soft_limit_tokens,
                "used_tokens": used.get(r.counter(principal.key_id, now), 0)} for r in principal.budgets]
    return {
        "object": "usage", "tenant": principal.tenant,
        "period": {"start": span.start.isoformat(), "end": span.last_day.isoformat()},
        "lines": [{k: v for k, v in r.items() if k not in _HIDDEN} for r in records if r["record"] == "line"],
        "totals": [{k: r[k] for k in _TOTAL_FIELDS} for r in records if r["record"] == "total"],
        "budgets": budgets,
    }
