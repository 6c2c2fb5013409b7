"""What every admin UI page shares: the login guard, forms checked for their CSRF token, the page
context, a one-time confirmation (flash) after a change, and failures shown as pages (a login
redirect, the form again with what was typed and the error, or the error with a way back) rather
than the API's JSON."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote, unquote

from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
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


FLASH_COOKIE = "lpx_admin_flash"
MAX_FLASH_CHARS = 200
MAX_TYPED_CHARS = 1000  # what a form shows again of one typed value


class LoginRequired(Exception):
    pass


@dataclass(frozen=True)
class FormError:
    """A form that was refused: which one (its element id), why, and what was typed into it."""

    form: str
    message: str
    values: dict[str, str] = field(default_factory=dict)

    def typed(self, form: str, name: str, default: str = "") -> str:
        if form != self.form:
            return default
        return self.values.get(name, default)[:MAX_TYPED_CHARS]


NO_FORM_ERROR = FormError("", "")


def flash(response: Response, message: str) -> Response:
    """Shows `message` once, on the next page this browser loads."""
    response.cookies.append(Cookie(key=FLASH_COOKIE, value=quote(message[:MAX_FLASH_CHARS]), path="/admin",
                                   max_age=60, httponly=True, samesite="strict"))
    return response


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


def page(request: Request, template: str, status: int = 200, form_error: FormError | None = None,
         **context: Any) -> Template:
    cookie = request.cookies.get(session.COOKIE, "")
    token = platform_of(request).settings.admin_token or ""
    notice = unquote(request.cookies.get(FLASH_COOKIE, ""))[:MAX_FLASH_CHARS]
    seen = [Cookie(key=FLASH_COOKIE, value="", path="/admin", max_age=0, httponly=True, samesite="strict")]
    errors = form_error or NO_FORM_ERROR
    return Template(template_name=template, status_code=status, headers=HEADERS, cookies=seen if notice else [],
                    context={"csrf": session.csrf_token(token, cookie) if cookie else "", "path": request.url.path,
                             "logged_in": bool(cookie) and logged_in(request), "flash": notice,
                             "form_error": errors, "typed": errors.typed, **context})


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
