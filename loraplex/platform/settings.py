"""Platform settings, read from LORAPLEX_* environment variables when the app is created.

Nothing reads the environment at import time, so tests and benchmarks build apps with whatever
settings they need side by side.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _flag(env: dict, name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{name} must be one of {', '.join(_TRUE + _FALSE[:-1])}, got {raw!r}")
    return value in _TRUE


def _number(env: dict, name: str, default: float, minimum: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {raw!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """Where state lives and how the gateway behaves. `database_url` None: a SQLite file in
    `data_dir`; `redis_url` None: in-process rate-limit counters (one instance only)."""

    data_dir: Path = Path(".loraplex")
    database_url: str | None = None
    redis_url: str | None = None
    redis_prefix: str = "loraplex:"
    admin_token: str | None = None
    # A cached key is re-read from the database after this long, so a key revoked or expired on
    # another instance is refused within it (the issue asks for one second).
    auth_cache_ttl_s: float = 0.5
    # How long the model and adapter catalog is cached; registrations made on this instance are
    # seen at once, those made elsewhere within this time.
    catalog_cache_ttl_s: float = 2.0
    rate_limit_fail_open: bool = False
    redis_timeout_s: float = 0.5

    @classmethod
    def from_env(cls, environ: dict | None = None) -> Settings:
        env = dict(os.environ if environ is None else environ)
        return cls(
            data_dir=Path(env.get("LORAPLEX_DATA_DIR") or ".loraplex"),
            database_url=env.get("LORAPLEX_DATABASE_URL") or None,
            redis_url=env.get("LORAPLEX_REDIS_URL") or None,
            redis_prefix=env.get("LORAPLEX_REDIS_PREFIX") or "loraplex:",
            admin_token=env.get("LORAPLEX_ADMIN_TOKEN") or None,
            auth_cache_ttl_s=_number(env, "LORAPLEX_AUTH_CACHE_TTL", 0.5, 0.0),
            catalog_cache_ttl_s=_number(env, "LORAPLEX_CATALOG_CACHE_TTL", 2.0, 0.0),
            rate_limit_fail_open=_flag(env, "LORAPLEX_RATE_LIMIT_FAIL_OPEN", False),
            redis_timeout_s=_number(env, "LORAPLEX_REDIS_TIMEOUT", 0.5, 0.01),
        )

    @property
    def effective_database_url(self) -> str:
        """The SQLAlchemy async URL (driver filled in); the embedded default is a SQLite file."""
        from loraplex.platform.db.database import async_url

        if self.database_url:
            return async_url(self.database_url)
        return f"sqlite+aiosqlite:///{self.data_dir / 'loraplex.db'}"
