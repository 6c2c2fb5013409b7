"""Who may use the admin UI: whoever knows LORAPLEX_ADMIN_TOKEN logs in with it once and gets a
cookie that proves it without holding it.

The cookie is `<issued unix time>.<nonce>.<HMAC-SHA256(token, "admin-ui|<issued>.<nonce>")>`. Any instance that has
the token checks it with no shared state; it expires after SESSION_S; changing the token ends every
session. It is HttpOnly and SameSite=Strict, and every form also carries a CSRF token derived from
the cookie, so no other site can post on an admin's behalf.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

COOKIE = "lpx_admin"
SESSION_S = 12 * 3600


def _mac(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def issue(token: str, now: float) -> str:
    session = f"{int(now)}.{secrets.token_hex(8)}"  # the nonce makes each login its own session
    return f"{session}.{_mac(token, 'admin-ui|' + session)}"


def valid(token: str | None, cookie: str | None, now: float) -> bool:
    if not token or not cookie:
        return False
    session, _, mac = cookie.rpartition(".")
    issued = session.partition(".")[0]
    if not issued.isdigit() or not 0 <= now - int(issued) < SESSION_S:
        return False
    return hmac.compare_digest(mac, _mac(token, "admin-ui|" + session))


def csrf_token(token: str, cookie: str) -> str:
    return _mac(token, "csrf|" + cookie)


def csrf_ok(token: str, cookie: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(given, csrf_token(token, cookie))
