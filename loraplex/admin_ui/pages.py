"""The admin UI's pages: the overview (engine, live charts, rejections and latency, models, adapters,
prices, usage), the tenants, and one tenant (keys, adapters, budgets, usage). They read through the
same tenancy and billing functions as the admin API; each renders again with a refused form's input."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from litestar import Request, get
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Stream, Template

from loraplex.admin_ui.charts import Series, stacked_bars
from loraplex.admin_ui.live import CHARTS
from loraplex.admin_ui.residency import MAX_LISTED, every_adapter, view
from loraplex.admin_ui.web import FormError, local_page, logged_in, page, to, when
from loraplex.billing.daily import daily_totals
from loraplex.billing.exports import Directory, invoice_lines
from loraplex.billing.periods import BUDGET_PERIODS, DEFAULT_BUDGET_PERIOD, current_month
from loraplex.billing.prices import list_prices
from loraplex.platform.admin.billing_api import budget_status, export_response
from loraplex.platform.db.tables import ApiKey, Tenant, as_utc, utcnow
from loraplex.platform.routing.learned.calibration import daily_shares
from loraplex.platform.state import Platform, PlatformDep
from loraplex.platform.tenancy import budgets, catalog, keys, tenants
from loraplex.platform.tenancy.billing import load_directory

DAYS = 30  # the usage charts' span
SHARE_DAYS = 14  # the span of `auto`'s shares per model


@dataclass(frozen=True)
class Usage:
    chart: object  # the SVG
    requests: int  # over the chart's days
    records: list[dict]  # this month's invoice records (lines, tenant totals, totals)
    month: str

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["record"] == kind]


async def _usage(platform: Platform, names: Directory, tenant_id: int | None = None) -> Usage:
    now = utcnow()
    last = now.date()
    month = current_month(now)
    async with platform.db.connect() as conn:
        days = await daily_totals(conn, last - timedelta(days=DAYS - 1), last, tenant_id)
        records = await invoice_lines(conn, month, names, tenant_id)
    chart = stacked_bars([d.day.isoformat() for d in days],
                         [Series("input tokens", "input", [d.prompt_tokens for d in days]),
                          Series("output tokens", "output", [d.completion_tokens for d in days])],
                         f"Tokens per UTC day, last {DAYS} days")
    return Usage(chart, sum(d.requests for d in days), records, month.start.strftime("%Y-%m"))


@get("/login", opt={"public": True})
async def login_page(request: Request, next: FromQuery[str] = "/admin") -> Template | Redirect:  # noqa: A002
    if logged_in(request):
        return to(local_page(next))
    return page(request, "login.html.j2", next=next)


@get("/")
async def overview(request: Request, platform: PlatformDep) -> Template:
    return await overview_page(request, platform)


async def overview_page(request: Request, platform: Platform, status: int = 200,
                        form_error: FormError | None = None) -> Template:
    served = {m.name for m in platform.engine.models()}
    stats = platform.engine.stats()
    async with platform.sessions() as session:
        models = await catalog.list_models(session)
        tenant_count = len(await tenants.list_tenants(session))
        names = await load_directory(session)
        shares = await daily_shares(session, utcnow() - timedelta(days=SHARE_DAYS))
        adapters, adapter_count = await every_adapter(session, stats)
    async with platform.db.connect() as conn:
        prices = [p.as_json() for p in await list_prices(conn)]
    return page(request, "overview.html.j2", status, form_error, stats=stats, replicas=platform.engine.replicas(),
                tenant_count=tenant_count, auto_shares=shares, share_days=SHARE_DAYS, router=platform.scorer.name,
                models=[(m, m.name in served) for m in models], prices=prices, usage=await _usage(platform, names),
                adapters=adapters, adapter_count=adapter_count, max_listed=MAX_LISTED, live_charts=CHARTS)


@get("/tenants")
async def tenant_list(request: Request, platform: PlatformDep) -> Template:
    return await tenants_page(request, platform)


async def tenants_page(request: Request, platform: Platform, status: int = 200,
                       form_error: FormError | None = None) -> Template:
    async with platform.sessions() as session:
        rows = await tenants.list_tenants(session)
    return page(request, "tenants.html.j2", status, form_error, tenants=rows, when=when)


@dataclass(frozen=True)
class KeyView:
    prefix: str
    name: str
    created: str
    expires: str
    state: str  # active, disabled (its tenant is), expired or revoked
    max_priority: str
    limits: str
    scope: str

    @property
    def label(self) -> str:
        """How a list names the key: its name and prefix, or the prefix alone."""
        return f"{self.name} ({self.prefix})" if self.name else self.prefix


def _key_view(k: ApiKey, tenant: Tenant, now: datetime) -> KeyView:
    state = ("revoked" if k.revoked_at else "expired" if k.expires_at and as_utc(k.expires_at) <= now
             else "disabled" if tenant.status != "active" else "active")
    limits = ", ".join(f"{v} {unit}" for v, unit in ((k.rpm_limit, "RPM"), (k.tpm_limit, "TPM")) if v) or "none"
    scope = "; ".join(f"{what}: {', '.join(names)}" for what, names in
                      (("models", k.allowed_models), ("adapters", k.allowed_adapters)) if names is not None)
    return KeyView(k.prefix, k.name or "", when(k.created_at), when(k.expires_at), state, k.max_priority, limits,
                   scope or "every model and adapter")


@get("/tenants/{name:str}")
async def tenant_page(request: Request, platform: PlatformDep, name: FromPath[str]) -> Template:
    return await one_tenant_page(request, platform, name)


async def one_tenant_page(request: Request, platform: Platform, name: str, status: int = 200,
                          form_error: FormError | None = None) -> Template:
    async with platform.sessions() as session:
        tenant = await tenants.get_tenant(session, name)
        key_rows = await keys.list_keys(session, name)
        adapters = await catalog.list_adapters(session, tenant.id)
        budget_rows = await budgets.list_budgets(session, name)
        names = await load_directory(session)
    now, stats = utcnow(), platform.engine.stats()
    key_views = [_key_view(k, tenant, now) for k in key_rows]
    key_labels = {k.prefix: k.label for k in key_views}
    return page(request, "tenant.html.j2", status, form_error, tenant=tenant, keys=key_views, key_labels=key_labels,
                adapters=[view(a, tenant.name, stats) for a in adapters],
                budgets=await budget_status(platform, budget_rows), periods=BUDGET_PERIODS.values(),
                default_period=DEFAULT_BUDGET_PERIOD, usage=await _usage(platform, names, tenant.id), when=when)


@get("/billing/export")
async def billing_export(platform: PlatformDep, period: FromQuery[str], format: FromQuery[str] = "csv",  # noqa: A002
                         detail: FromQuery[bool] = False, tenant: FromQuery[str | None] = None) -> Stream:
    """The admin API's export, downloaded with the session's cookie instead of the bearer token."""
    return await export_response(platform, period, format, detail, tenant or None)


page_handlers = [login_page, overview, tenant_list, tenant_page, billing_export]
