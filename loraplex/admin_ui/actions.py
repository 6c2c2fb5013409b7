"""The admin UI's forms: log in and out, create tenants and keys, enable and disable tenants, set a
tenant's default max_tokens, set and remove budgets, add prices, put models in `auto`'s pool, revoke
keys, delete adapters. Each goes through the same platform functions as the admin API and answers
with a redirect to the page that shows the result (a new key is shown once, on its own page); a
refused form comes back on its page with what was typed and why."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from litestar import Request, post
from litestar.datastructures import Cookie
from litestar.params import FromPath
from litestar.response import Redirect, Response, Template

from loraplex.admin_ui import session
from loraplex.admin_ui.pages import one_tenant_page, overview_page, tenants_page
from loraplex.admin_ui.web import FormError, checked_form, flash, local_page, page, platform_of, to
from loraplex.billing.prices import PriceSpec
from loraplex.platform.admin.api import check_admin_token
from loraplex.platform.db.tables import utcnow
from loraplex.platform.errors import invalid, platform_error_of
from loraplex.platform.routing.learned import calibration
from loraplex.platform.state import Platform, PlatformDep
from loraplex.platform.tenancy import catalog, keys, tenants

Again = Callable[..., Awaitable[Template]]  # renders a form's page: (status=, form_error=)


async def _form(request: Request, form_id: str, again: Again, work: Callable[[dict], Awaitable[Response]]):
    """Runs `work(form)`; when the input is refused (4xx), the form's page again with the error and what
    was typed, in place of a separate error page (faults of the server still go to the error page)."""
    form = await checked_form(request)
    try:
        return await work(form)
    except Exception as exc:  # noqa: BLE001 (classified as the API would answer it)
        error = platform_error_of(request, exc)
        if error.status >= 500 or error.status in (401, 403):
            if error is exc:
                raise
            raise error from exc
        typed = {k: v for k, v in form.items() if k != "csrf"}
        return await again(status=error.status, form_error=FormError(form_id, error.message, typed))


@post("/login", opt={"public": True})
async def login(request: Request) -> Template | Redirect:
    form = await request.form()
    token = platform_of(request).settings.admin_token
    given, next_page = str(form.get("token") or ""), str(form.get("next") or "/admin")
    if not check_admin_token(request, given):
        return page(request, "login.html.j2", status=401, next=next_page, error="That is not the admin token.")
    redirect = to(local_page(next_page))
    redirect.cookies.append(Cookie(key=session.COOKIE, value=session.issue(token, time.time()), path="/admin",
                                   max_age=session.SESSION_S, httponly=True, samesite="strict",
                                   secure=request.url.scheme == "https"))
    return redirect


@post("/logout")
async def logout(request: Request) -> Redirect:
    await checked_form(request)
    redirect = to("/admin/login")
    redirect.cookies.append(Cookie(key=session.COOKIE, value="", path="/admin", max_age=0, httponly=True,
                                   samesite="strict"))
    return redirect


@post("/tenants")
async def create_tenant(request: Request, platform: PlatformDep) -> Response:
    async def work(form: dict) -> Response:
        name, tier = form.get("name", "").strip(), form.get("tier", "").strip() or "standard"
        async with platform.sessions() as s:
            tenant = await tenants.create_tenant(s, name, tier)
        return to(f"/admin/tenants/{tenant.name}")

    return await _form(request, "new-tenant", lambda **kw: tenants_page(request, platform, **kw), work)


@post("/tenants/{name:str}/status")
async def set_status(request: Request, platform: PlatformDep, name: FromPath[str]) -> Redirect:
    form = await checked_form(request)
    await platform.set_tenant_status(name, form.get("status", ""))
    return to(f"/admin/tenants/{name}")


def _positive(form: dict[str, str], field: str, kind=int):
    raw = form.get(field, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not 0 < value < math.inf:  # also refuses nan and inf
        raise invalid(f"{field.replace('_', ' ')} must be a positive number, got {raw!r}", field)
    return value


def _names(form: dict[str, str], field: str) -> tuple[str, ...] | None:
    """A comma-separated list; blank means no restriction."""
    names = tuple(n.strip() for n in form.get(field, "").split(",") if n.strip())
    return names or None


def _tenant_again(request: Request, platform: Platform, name: str) -> Again:
    return lambda **kw: one_tenant_page(request, platform, name, **kw)


@post("/tenants/{name:str}/keys")
async def create_key(request: Request, platform: PlatformDep, name: FromPath[str]) -> Response:
    async def work(form: dict) -> Response:
        days = _positive(form, "expires_in_days", float)
        spec = keys.KeySpec(name=form.get("key_name", "").strip() or None,
                            expires_at=utcnow() + timedelta(days=days) if days else None,
                            max_priority=form.get("max_priority", "standard"),
                            rpm_limit=_positive(form, "rpm_limit"), tpm_limit=_positive(form, "tpm_limit"),
                            allowed_models=_names(form, "allowed_models"),
                            allowed_adapters=_names(form, "allowed_adapters"))
        async with platform.sessions() as s:
            row, secret = await keys.create_key(s, name, spec)
        return page(request, "key_created.html.j2", status=201, tenant=name, prefix=row.prefix, key=secret)

    return await _form(request, "new-key-form", _tenant_again(request, platform, name), work)


@post("/tenants/{name:str}/default-max-tokens")
async def set_default_max_tokens(request: Request, platform: PlatformDep, name: FromPath[str]) -> Response:
    """What a request without max_tokens may generate (blank: the platform's default)."""
    async def work(form: dict) -> Response:
        value = _positive(form, "default_max_tokens")
        async with platform.sessions() as s:
            await tenants.set_default_max_tokens(s, name, value)
        platform.catalog_changed()
        shown = f"{value:,} tokens" if value else "the platform default"
        return flash(to(f"/admin/tenants/{name}"), f"Requests of {name} without max_tokens now generate up to {shown}.")

    return await _form(request, "max-tokens-form", _tenant_again(request, platform, name), work)


@post("/tenants/{name:str}/budgets")
async def set_budget(request: Request, platform: PlatformDep, name: FromPath[str]) -> Response:
    async def work(form: dict) -> Response:
        limit = _positive(form, "limit_tokens")
        if limit is None:
            raise invalid("limit tokens must be a positive number, got ''", "limit_tokens")
        row = await platform.set_budget(name, form.get("period", ""), limit, _positive(form, "soft_limit_tokens"),
                                        form.get("key", "").strip() or None)
        who = f"key {row.key.name or row.key.prefix}" if row.key else f"tenant {name}"
        return flash(to(f"/admin/tenants/{name}#budgets"),
                     f"Budget set: {who}, {limit:,} tokens per {row.period}.")

    return await _form(request, "budget-form", _tenant_again(request, platform, name), work)


@post("/tenants/{name:str}/budgets/delete")
async def delete_budget(request: Request, platform: PlatformDep, name: FromPath[str]) -> Redirect:
    form = await checked_form(request)
    await platform.delete_budget(name, form.get("period", ""), form.get("key", "").strip() or None)
    return to(f"/admin/tenants/{name}#budgets")


@post("/prices")
async def add_price(request: Request, platform: PlatformDep) -> Response:
    """A price from `effective_from` (UTC; blank: now) on; prices in force are never changed."""
    async def work(form: dict) -> Response:
        raw = form.get("effective_from", "").strip()
        try:
            start = datetime.fromisoformat(raw).replace(tzinfo=UTC) if raw else None
        except ValueError:
            raise invalid(f"effective from must be a date and time, got {raw[:40]!r}", "effective_from") from None
        spec = PriceSpec(form.get("model", ""), form.get("input_per_1m", ""), form.get("cached_input_per_1m", ""),
                         form.get("output_per_1m", ""), form.get("currency", "").strip().upper() or "USD", start)
        price = (await platform.add_price(spec)).as_json()
        return flash(to("/admin#prices"), f"Price added for {price['model']}: input {price['input_per_1m']}, "
                                          f"output {price['output_per_1m']} {price['currency']} per 1M tokens.")

    return await _form(request, "price-form", lambda **kw: overview_page(request, platform, **kw), work)


@post("/models/route")
async def set_auto_route(request: Request, platform: PlatformDep) -> Redirect:
    """A model's auto_max_complexity (blank: out of `auto`'s pool)."""
    form = await checked_form(request)
    value = catalog.parse_max_complexity(form.get("auto_max_complexity", ""))
    await platform.set_auto_route(form.get("model", ""), value)
    return to("/admin#models")


@post("/models/calibrate")
async def calibrate_auto(request: Request, platform: PlatformDep) -> Response:
    """auto's limits for a share of the window's traffic to the most capable model (routing/learned/calibration.py)."""
    async def work(form: dict) -> Response:
        raw = form.get("strong_share", "").strip()
        try:
            share = float(raw)
        except ValueError:
            raise invalid(f"strong_share must be a number from 0 to 1, got {raw[:20]!r}", "strong_share") from None
        await platform.calibrate_auto(calibration.parse_window(form.get("since", "7d")), share)
        return to("/admin#auto-shares")

    return await _form(request, "calibrate-form", lambda **kw: overview_page(request, platform, **kw), work)


@post("/keys/{prefix:str}/revoke")
async def revoke_key(request: Request, platform: PlatformDep, prefix: FromPath[str]) -> Redirect:
    await checked_form(request)
    row = await platform.revoke_key(prefix)
    return to(f"/admin/tenants/{row.tenant.name}")


@post("/tenants/{name:str}/adapters/{adapter:str}/delete")
async def delete_adapter(request: Request, platform: PlatformDep, name: FromPath[str],
                         adapter: FromPath[str]) -> Redirect:
    await checked_form(request)
    await platform.delete_adapter(name, adapter)
    return to(f"/admin/tenants/{name}")


action_handlers = [login, logout, create_tenant, set_status, create_key, set_default_max_tokens, set_budget,
                   delete_budget, add_price, set_auto_route, calibrate_auto, revoke_key, delete_adapter]
