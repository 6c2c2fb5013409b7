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


def _number(env: dict, name: str, default, minimum, kind=float):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {raw!r}")
    return value


def _choice(env: dict, name: str, default: str, choices: tuple[str, ...]) -> str:
    value = (env.get(name) or default).strip().lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {env.get(name)!r}")
    return value


def _integer(env: dict, name: str, default: int | None, minimum: int) -> int | None:
    return _number(env, name, default, minimum, int)


@dataclass(frozen=True)
class Settings:
    """Where state lives and how the gateway behaves. `database_url` None: a SQLite file in
    `data_dir`; `redis_url` None: in-process rate-limit counters (one instance only)."""

    data_dir: Path = Path(".loraplex")
    database_url: str | None = None
    redis_url: str | None = None
    redis_prefix: str = "loraplex:"
    admin_token: str | None = None
    # GET /metrics/endpoint-picker without the admin token: the four gauges a Kubernetes inference gateway's
    # endpoint picker scrapes (queue, running, KV use, adapters by engine id; no tenant). Off: 404.
    picker_metrics: bool = False
    # Wrong admin tokens from one address before it is refused for the rest of the window (0: no limit).
    admin_auth_max_failures: int = 10
    admin_auth_window_s: float = 300.0
    # Failed tenant authentications (401s on /v1) from one address before it is answered 429 for
    # the rest of the window (0: no limit). Behind a proxy every client shares its address.
    auth_max_failures: int = 100
    auth_failure_window_s: float = 60.0
    # The largest request body the APIs read (413 beyond it); adapter blob uploads have their own
    # limit, adapter_max_bytes.
    max_body_bytes: int = 2 << 20
    # A cached key is re-read from the database after this long, so a key revoked or expired on
    # another instance is refused within it (the issue asks for one second).
    auth_cache_ttl_s: float = 0.5
    # How long the model and adapter catalog is cached; registrations made on this instance are
    # seen at once, those made elsewhere within this time.
    catalog_cache_ttl_s: float = 2.0
    # How often this instance drops from its engine the adapters deleted through another instance
    # (this one's deletions it drops at once; 0: never).
    adapter_sweep_interval_s: float = 30.0
    # Where uploaded adapters are kept (None: data_dir/adapter-store); instances that share their
    # database must share it too, mounted at the same path. Uploads beyond the byte limit are refused.
    adapter_store_dir: Path | None = None
    adapter_max_bytes: int = 4 << 30
    rate_limit_fail_open: bool = False
    redis_timeout_s: float = 0.5
    # The usage ledger: batches of at most this many rows, written at least this often; events
    # beyond the queue bound go straight to the spool (data_dir/spool) until the database keeps up.
    ledger_batch_size: int = 200
    ledger_flush_interval_s: float = 0.2
    ledger_queue_size: int = 10_000
    # While the ledger database is down: serve and spool usage (True) or answer 503 (False).
    ledger_fail_open: bool = True
    # A generation running longer than this is aborted and charged what it generated (0: never).
    request_timeout_s: float = 600.0
    # What a request without max_tokens may generate, unless its tenant sets its own (None: the
    # rest of the context). It is also what such a request reserves of a budget.
    default_max_tokens: int | None = None
    # How long cached keys and models keep serving while the database is unreachable.
    db_outage_grace_s: float = 900.0
    # Postgres: opening a connection gives up after this long (so an outage that drops packets is
    # noticed in seconds and cached keys keep serving), a statement after this long (0: never).
    db_connect_timeout_s: float = 2.0
    db_command_timeout_s: float = 30.0
    # Budget counters: how often this process reconciles them with the ledger and heartbeats,
    # and after how long without a heartbeat another process counts as dead.
    reconcile_interval_s: float = 1.0
    dead_process_after_s: float = 30.0
    # On SIGTERM `serve` stops admitting generations and waits this long for those in flight; what
    # is still running then is aborted and billed what it generated.
    drain_timeout_s: float = 30.0
    # `model: "auto"` scores requests with the learned scorer (weights: router_weights, else the ones
    # shipped in the package) or the hand-set heuristic (complexity.py); docs/routing.md.
    router: str = "learned"
    router_weights: Path | None = None

    @classmethod
    def from_env(cls, environ: dict | None = None) -> Settings:
        env = dict(os.environ if environ is None else environ)
        return cls(
            data_dir=Path(env.get("LORAPLEX_DATA_DIR") or ".loraplex"),
            database_url=env.get("LORAPLEX_DATABASE_URL") or None,
            redis_url=env.get("LORAPLEX_REDIS_URL") or None,
            redis_prefix=env.get("LORAPLEX_REDIS_PREFIX") or "loraplex:",
            admin_token=env.get("LORAPLEX_ADMIN_TOKEN") or None,
            picker_metrics=_flag(env, "LORAPLEX_PICKER_METRICS", False),
            admin_auth_max_failures=_integer(env, "LORAPLEX_ADMIN_AUTH_MAX_FAILURES", 10, 0),
            admin_auth_window_s=_number(env, "LORAPLEX_ADMIN_AUTH_WINDOW", 300.0, 1.0),
            auth_max_failures=_integer(env, "LORAPLEX_AUTH_MAX_FAILURES", 100, 0),
            auth_failure_window_s=_number(env, "LORAPLEX_AUTH_FAILURE_WINDOW", 60.0, 1.0),
            max_body_bytes=_integer(env, "LORAPLEX_MAX_BODY_BYTES", 2 << 20, 1024),
            auth_cache_ttl_s=_number(env, "LORAPLEX_AUTH_CACHE_TTL", 0.5, 0.0),
            catalog_cache_ttl_s=_number(env, "LORAPLEX_CATALOG_CACHE_TTL", 2.0, 0.0),
            adapter_sweep_interval_s=_number(env, "LORAPLEX_ADAPTER_SWEEP_INTERVAL", 30.0, 0.0),
            adapter_store_dir=Path(env["LORAPLEX_ADAPTER_STORE"]) if env.get("LORAPLEX_ADAPTER_STORE") else None,
            adapter_max_bytes=_integer(env, "LORAPLEX_ADAPTER_MAX_BYTES", 4 << 30, 1),
            rate_limit_fail_open=_flag(env, "LORAPLEX_RATE_LIMIT_FAIL_OPEN", False),
            redis_timeout_s=_number(env, "LORAPLEX_REDIS_TIMEOUT", 0.5, 0.01),
            ledger_batch_size=_integer(env, "LORAPLEX_LEDGER_BATCH_SIZE", 200, 1),
            ledger_flush_interval_s=_number(env, "LORAPLEX_LEDGER_FLUSH_INTERVAL", 0.2, 0.01),
            ledger_queue_size=_integer(env, "LORAPLEX_LEDGER_QUEUE_SIZE", 10_000, 1),
            ledger_fail_open=_flag(env, "LORAPLEX_LEDGER_FAIL_OPEN", True),
            request_timeout_s=_number(env, "LORAPLEX_REQUEST_TIMEOUT", 600.0, 0.0),
            default_max_tokens=_integer(env, "LORAPLEX_DEFAULT_MAX_TOKENS", None, 1),
            db_outage_grace_s=_number(env, "LORAPLEX_DB_OUTAGE_GRACE", 900.0, 0.0),
            db_connect_timeout_s=_number(env, "LORAPLEX_DB_CONNECT_TIMEOUT", 2.0, 0.1),
            db_command_timeout_s=_number(env, "LORAPLEX_DB_COMMAND_TIMEOUT", 30.0, 0.0),
            reconcile_interval_s=_number(env, "LORAPLEX_BUDGET_RECONCILE_INTERVAL", 1.0, 0.05),
            dead_process_after_s=_number(env, "LORAPLEX_DEAD_PROCESS_AFTER", 30.0, 1.0),
            drain_timeout_s=_number(env, "LORAPLEX_DRAIN_TIMEOUT", 30.0, 0.0),
            router=_choice(env, "LORAPLEX_ROUTER", "learned", ("learned", "heuristic")),
            router_weights=Path(env["LORAPLEX_ROUTER_WEIGHTS"]) if env.get("LORAPLEX_ROUTER_WEIGHTS") else None,
        )

    @property
    def spool_dir(self) -> Path:
        return self.data_dir / "spool"

    @property
    def adapter_store_root(self) -> Path:
        return (self.adapter_store_dir or self.data_dir / "adapter-store").absolute()

    @property
    def effective_database_url(self) -> str:
        """The SQLAlchemy async URL (driver filled in); the embedded default is a SQLite file."""
        from loraplex.platform.db.database import async_url

        if self.database_url:
            return async_url(self.database_url)
        return f"sqlite+aiosqlite:///{self.data_dir / 'loraplex.db'}"
