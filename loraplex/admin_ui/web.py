"""What every admin UI page shares: the login guard, forms checked for their CSRF token, the page
context, and failures shown as pages (a login redirect, or the error with a way back) rather than
the API's JSON."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any
from urllib.parse import quote

from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.response import Redirect, Template

from loraplex.admin_ui import session
from loraplex.platform.db.tables import as_utc
from loraplex.platform.errors import PlatformError, platform_error_of
from loraplex.platform.state import Platform

# Pages hold tenants' data: never cached, never framed, and only this server's own styles and script.
HEADERS = {"cache-control": "no-store", "x-frame-options": "DENY", "referrer-policy": "same-origin",
           "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                                      "form-action 'self'"}


class LoginRequired(Exception):
    pass


def platform_of(connection: ASGIConnection) -> Platform:
    return connection.app.state.platform


def logged_in(connection: ASGIConnection) -> bool:
    return session.valid(platform_of(connection).settings.admin_token, connection.cookies.get(session.COOKIE),
                         time.time())


def ui_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Every page but the login's needs a session; none works without an admin token configured."""
    if not platform_of(connection).settings.admin_token:
        raise PlatformError(403, "The admin UI is disabled: set LORAPLEX_ADMIN_TOKEN to enable it.",
                            code="admin_disabled")
    if not handler.opt.get("public") and not logged_in(connection):
        raise LoginRequired


async def checked_form(request: Request) -> dict[str, str]:
    """The posted form, once its CSRF token matches this session's."""
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    token = platform_of(request).settings.admin_token or ""
    if not session.csrf_ok(token, request.cookies.get(session.COOKIE, ""), form.get("csrf")):
        raise PlatformError(403, "This form is stale or came from another site: reload the page and try again.",
                            code="csrf_failed")
    return form


def page(request: Request, template: str, status: int = 200, **context: Any) -> Template:
    cookie = request.cookies.get(session.COOKIE, "")
    token = platform_of(request).settings.admin_token or ""
    return Template(template_name=template, status_code=status, headers=HEADERS,
                    context={"csrf": session.csrf_token(token, cookie) if cookie else "", "path": request.url.path,
                             "logged_in": bool(cookie) and logged_in(request), **context})


def to(path: str) -> Redirect:
    return Redirect(path, status_code=303, headers=HEADERS)


def local_page(path: str) -> str:
    """Where a login may send the browser on: one of these pages, never another site."""
    return path if path.startswith("/admin") else "/admin"


def when(value: datetime | None) -> str:
    """A database time as UTC minutes, for tables."""
    return as_utc(value).strftime("%Y-%m-%d %H:%M") if value else ""


def handle_login_required(request: Request, _: LoginRequired) -> Response:
    return to(f"/admin/login?next={quote(request.url.path)}")


def handle_error(request: Request, exc: Exception) -> Response:
    """The error the API would answer (the same statuses, messages and logging), as a page."""
    error = platform_error_of(request, exc)
    return page(request, "error.html.j2", status=error.status, message=error.message)
