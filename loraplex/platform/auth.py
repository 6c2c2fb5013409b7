"""Bearer-key authentication with a short in-process cache (cache.py), so revocation spreads without a message bus.

- A key is served from the cache for at most `ttl_s` (default 0.5 s) after its row was read, so a key revoked, or a
  tenant disabled, on any instance is refused everywhere within that time. A key in use is re-read in the
  background before that, so requests do not wait for the database.
- Expiry is checked on every request against the cached time, so it is exact.
- Only valid keys enter that cache, so no number of bad keys can push a good one out. Refusals (unknown, revoked,
  disabled) go to a small bounded cache of their own, so a client retrying one bad key costs one query per TTL; a
  flood of distinct bad keys is throttled per address (auth_throttle.py).
- Concurrent misses for the same key share one query.
- The principal carries the budgets of its tenant and key, so budget changes also reach every instance within the TTL.
- While the database is down, cached keys keep working for `outage_grace_s` (outage.py).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

from litestar.connection import ASGIConnection
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.billing.budgets import BudgetRule
from loraplex.billing.ratelimit import Limits
from loraplex.platform.cache import RefreshingCache
from loraplex.platform.db.tables import ApiKey, as_utc, utcnow
from loraplex.platform.errors import unauthorized
from loraplex.platform.tenancy.budgets import rules_for_key
from loraplex.platform.tenancy.keys import find_by_secret_hash, hash_key, looks_like_key

MAX_KEY_CHARS = 128  # our keys have 47; anything longer is refused without hashing or a lookup
MAX_REFUSALS = 4096  # refused keys remembered (for one TTL) at once; the oldest are forgotten first
MISSING_KEY = ("You didn't provide an API key. Send it in the Authorization header: "
               "'Authorization: Bearer lpx-...'.")
WRONG_KEY = "Incorrect API key provided."


@dataclass(frozen=True)
class Principal:
    """Who is calling and what their key allows."""

    key_id: int
    key_prefix: str
    tenant_id: int
    tenant: str
    tier: str
    max_priority: str
    allowed_models: frozenset[str] | None
    allowed_adapters: frozenset[str] | None
    limits: Limits
    expires_at: datetime | None
    budgets: tuple[BudgetRule, ...] = ()
    default_max_tokens: int | None = None  # the tenant's cap for requests without max_tokens

    @functools.cached_property  # the principal is cached with its key: hashed once, not per request
    def cache_salt(self) -> str:
        """Prefix-cache isolation: blocks are shared only within a tenant."""
        return hashlib.sha256(f"loraplex-tenant:{self.tenant_id}".encode()).hexdigest()[:32]

    @property
    def rate_subject(self) -> str:
        return f"key:{self.key_id}"


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated request: who, and when it arrived (kept in its ASGI scope)."""

    principal: Principal
    arrived: float  # time.perf_counter(): TTFT and latency count from here, auth included
    arrived_at: datetime  # the request's time: its budget periods and its price


CALLER_KEY = "loraplex.caller"


def caller_of(connection: ASGIConnection) -> Caller:
    """The caller the tenant API's guard authenticated (one scope lookup, no State objects)."""
    return connection.scope[CALLER_KEY]  # type: ignore[literal-required]


def principal_of(row: ApiKey, budgets: tuple[BudgetRule, ...] = ()) -> Principal | str:
    """The principal for a key row, or the reason it is refused."""
    if row.revoked_at is not None:
        return "This API key has been revoked."
    if row.tenant.status != "active":
        return "This API key's tenant is disabled."
    return Principal(
        key_id=row.id, key_prefix=row.prefix, tenant_id=row.tenant_id, tenant=row.tenant.name, tier=row.tenant.tier,
        max_priority=row.max_priority,
        allowed_models=frozenset(row.allowed_models) if row.allowed_models is not None else None,
        allowed_adapters=frozenset(row.allowed_adapters) if row.allowed_adapters is not None else None,
        limits=Limits(rpm=row.rpm_limit, tpm=row.tpm_limit), expires_at=as_utc(row.expires_at), budgets=budgets,
        default_max_tokens=row.tenant.default_max_tokens)


class AuthCache:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl_s: float = 0.5, max_entries: int = 100_000,
                 clock=time.monotonic, outage_grace_s: float = 900.0):
        self._sessions = sessions
        self._cache: RefreshingCache[str, Principal | str] = RefreshingCache(
            self._load, ttl_s, what="API keys", grace_s=outage_grace_s, max_entries=max_entries, clock=clock,
            keep=lambda found: isinstance(found, Principal))
        self._refused = Refusals(ttl_s, MAX_REFUSALS, clock)

    async def authenticate(self, authorization: str | None) -> Principal:
        key = _bearer(authorization)
        if key is None:
            raise unauthorized(MISSING_KEY)
        if len(key) > MAX_KEY_CHARS or not looks_like_key(key):
            raise unauthorized(WRONG_KEY)
        secret_hash = hash_key(key)
        refused = self._refused.get(secret_hash)
        if refused is not None:
            raise unauthorized(refused)
        found = await self._cache.get(secret_hash)
        if isinstance(found, str):
            self._refused.add(secret_hash, found)
            raise unauthorized(found)
        if found.expires_at is not None and found.expires_at <= utcnow():
            raise unauthorized("This API key has expired.")
        return found

    def invalidate(self) -> None:
        """Forgets every entry (after a revocation or a tenant change made on this instance)."""
        self._cache.invalidate()
        self._refused.clear()

    @property
    def cached_keys(self) -> int:
        """How many valid keys the cache holds (tests, diagnostics)."""
        return len(self._cache)

    async def _load(self, secret_hash: str) -> Principal | str:
        async with self._sessions() as session:
            row = await find_by_secret_hash(session, secret_hash)
            if row is None:
                return WRONG_KEY
            return principal_of(row, await rules_for_key(session, row.tenant_id, row.id))


class Refusals:
    """Why recently refused keys were refused, for `ttl_s` each and at most `max_entries` of them
    (the oldest forgotten first): bounded whatever keys clients make up."""

    def __init__(self, ttl_s: float, max_entries: int, clock=time.monotonic):
        self._ttl, self._max, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def get(self, secret_hash: str) -> str | None:
        entry = self._entries.get(secret_hash)
        if entry is None:
            return None
        if self._clock() - entry[0] >= self._ttl:
            del self._entries[secret_hash]
            return None
        return entry[1]

    def add(self, secret_hash: str, reason: str) -> None:
        if self._ttl <= 0:
            return
        self._entries[secret_hash] = (self._clock(), reason)
        self._entries.move_to_end(secret_hash)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
