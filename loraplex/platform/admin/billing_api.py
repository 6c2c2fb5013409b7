"""The admin API's billing calls under /admin/api/: budgets, prices and exports.

POST /budgets sets (creates or replaces) a budget, GET /budgets lists them with what the ledger
and the live counters say is used, DELETE /budgets removes one; POST/GET /prices add and list
prices; GET /billing/export streams a period's invoice lines or requests as CSV or JSON Lines.
"""

from __future__ import annotations

from litestar import Response, Router, delete, get, post
from litestar.params import FromQuery, JSONBody
from litestar.response import Stream

from loraplex.billing.counters import CountersUnavailable
from loraplex.billing.prices import PriceSpec, list_prices
from loraplex.billing.rebuild import tenant_usage
from loraplex.billing.usage import utcnow
from loraplex.platform.admin.api import admin_guard
from loraplex.platform.admin.billing_schemas import BudgetIn, BudgetOut, PriceIn, PriceOut, budget_out, price_out
from loraplex.platform.db.tables import Budget
from loraplex.platform.state import Platform, PlatformDep
from loraplex.platform.tenancy import budgets
from loraplex.platform.tenancy.billing import prepare_export
from loraplex.platform.tenancy.budgets import rule_of


async def budget_status(platform: Platform, rows: list[Budget]) -> list[BudgetOut]:
    """Each budget with its current period's usage by the ledger and by the live counters."""
    now, out = utcnow(), []
    used_by_tenant: dict[int, dict[str, int]] = {}
    for row in rows:
        if row.tenant_id not in used_by_tenant:
            used_by_tenant[row.tenant_id] = (await tenant_usage(platform.db, row.tenant_id, now, fenced=False))[1]
        name = rule_of(row).counter(row.key_id, now)
        try:
            counter = (await platform.quota.read(row.tenant_id, (name,)))[name]
        except CountersUnavailable:
            counter = None
        out.append(budget_out(row, used_by_tenant[row.tenant_id].get(name, 0), counter))
    return out


@post("/budgets", status_code=200)
async def set_budget(platform: PlatformDep, data: JSONBody[BudgetIn]) -> BudgetOut:
    row = await platform.set_budget(data.tenant, data.period, data.limit_tokens, data.soft_limit_tokens, data.key)
    return (await budget_status(platform, [row]))[0]


@get("/budgets")
async def list_budgets(platform: PlatformDep, tenant: FromQuery[str | None] = None) -> list[BudgetOut]:
    async with platform.sessions() as session:
        rows = await budgets.list_budgets(session, tenant)
    return await budget_status(platform, rows)


@delete("/budgets", status_code=200)
async def delete_budget(platform: PlatformDep, tenant: FromQuery[str], period: FromQuery[str],
                        key: FromQuery[str | None] = None) -> dict:
    await platform.delete_budget(tenant, period, key)
    return {"deleted": True, "tenant": tenant, "period": period, "key": key}


@post("/prices", status_code=201)
async def add_price(platform: PlatformDep, data: JSONBody[PriceIn]) -> PriceOut:
    spec = PriceSpec(data.model, data.input_per_1m, data.cached_input_per_1m, data.output_per_1m, data.currency,
                     data.effective_from)
    return price_out(await platform.add_price(spec))


@get("/prices")
async def get_prices(platform: PlatformDep, model: FromQuery[str | None] = None) -> list[PriceOut]:
    async with platform.db.connect() as conn:
        return [price_out(p) for p in await list_prices(conn, model)]


@get("/billing/export", media_type="text/csv")
async def export_billing(platform: PlatformDep, period: FromQuery[str], format: FromQuery[str] = "csv",
                         tenant: FromQuery[str | None] = None, detail: FromQuery[bool] = False) -> Response:
    return await export_response(platform, period, format, detail, tenant)


async def export_response(platform: Platform, period: str, fmt: str, detail: bool, tenant: str | None) -> Stream:
    """The export as a download; everything is checked before the first byte (the admin UI's too)."""
    async with platform.sessions() as session:
        job = await prepare_export(session, period, fmt, detail, tenant)
    return Stream(job.stream(platform.db), media_type=job.media_type,
                  headers={"content-disposition": f'attachment; filename="{job.filename}"'})


admin_billing_router = Router(
    path="/admin/api", guards=[admin_guard], tags=["admin", "billing"],
    route_handlers=[set_budget, list_budgets, delete_budget, add_price, get_prices, export_billing])
