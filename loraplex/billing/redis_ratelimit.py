"""RPM/TPM buckets in Redis, shared by every app instance; each operation is one Lua script.

The script reads the clock with Redis TIME, so instances with skewed clocks agree. A bucket is a
hash {l: level, t: time}; it expires once it would be full again, and a missing bucket is full.
Both keys of a subject share a hash tag, so the script also works on a Redis cluster. `COMMON` and
`BUCKETS` are Lua fragments that the budget counters (redis_counters.py) build their scripts from.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import RedisError

from loraplex.billing.ratelimit import Decision, Limits, RateLimiterUnavailable, window

COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, cap)
  local s = redis.call('HMGET', key, 'l', 't')
  local l, ts = tonumber(s[1]), tonumber(s[2])
  if l == nil then return cap end
  return math.min(cap, l + math.max(0, now - ts) * cap / 60)
end
local function save(key, l, cap)
  redis.call('HSET', key, 'l', tostring(l), 't', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((cap - l) * 60000 / cap) + 1000)
end
"""

# take(): one request and `tokens` (capped at the TPM limit) from both buckets, or from neither.
# Returns {allowed, request level, token level, seconds to wait, tokens reserved}.
# give(): `n` tokens back to a token bucket (negative: a debt). The budget counters' scripts
# (redis_counters.py) run the same functions inside their own, so both stores agree.
BUCKETS = """
local function take(kreq, ktok, rpm, tpm, tokens)
  local cost, lr, lt, wait = 0, -1, -1, 0
  if rpm > 0 then
    lr = level(kreq, rpm)
    wait = math.max(wait, (1 - lr) * 60 / rpm)
  end
  if tpm > 0 then
    cost = math.min(tokens, tpm)
    lt = level(ktok, tpm)
    wait = math.max(wait, (cost - lt) * 60 / tpm)
  end
  local ok = wait <= 0
  if ok then
    if rpm > 0 then lr = lr - 1; save(kreq, lr, rpm) end
    if tpm > 0 then lt = lt - cost; save(ktok, lt, tpm) end
  else
    cost = 0
  end
  return {ok and 1 or 0, tostring(lr), tostring(lt), tostring(math.max(wait, 0)), cost}
end
local function give(ktok, tpm, n)
  save(ktok, math.min(tpm, level(ktok, tpm) + n), tpm)
end
"""

# KEYS: request bucket, token bucket. ARGV: rpm (0 = none), tpm (0 = none), tokens.
ACQUIRE = COMMON + BUCKETS + """
return take(KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]))
"""

# KEYS: token bucket. ARGV: tpm, tokens to give back (negative: a debt).
SETTLE = COMMON + BUCKETS + """
give(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))
return 1
"""


def decision(limits: Limits, ok: int, lr: str, lt: str, wait: str, cost: int = 0) -> Decision:
    """A Decision from what take() returned."""
    return Decision(
        allowed=bool(ok),
        requests=window(limits.rpm, float(lr)) if limits.rpm else None,
        tokens=window(limits.tpm, float(lt)) if limits.tpm else None,
        retry_after_s=float(wait), reserved_tokens=int(cost))


class RedisStore:
    """What every store on a Redis client shares: ping and close."""

    def __init__(self, client: Redis):
        self._client = client

    async def ping(self) -> bool:
        try:
            return bool(await self._client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._client.aclose()


class RedisRateLimiter(RedisStore):
    def __init__(self, client: Redis, prefix: str = "loraplex:"):
        super().__init__(client)
        self._prefix = prefix
        self._acquire = client.register_script(ACQUIRE)
        self._settle = client.register_script(SETTLE)

    @classmethod
    def from_url(cls, url: str, prefix: str = "loraplex:", timeout_s: float = 0.5) -> RedisRateLimiter:
        client = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, prefix)

    def _keys(self, subject: str) -> list[str]:
        base = f"{self._prefix}rl:{{{subject}}}"
        return [f"{base}:req", f"{base}:tok"]

    async def acquire(self, subject: str, limits: Limits, tokens: int) -> Decision:
        try:
            ok, lr, lt, wait, cost = await self._acquire(
                keys=self._keys(subject), args=[limits.rpm or 0, limits.tpm or 0, max(0, tokens)])
        except (RedisError, OSError) as exc:
            raise RateLimiterUnavailable(str(exc)) from None
        return decision(limits, ok, lr, lt, wait, cost)

    async def settle(self, subject: str, limits: Limits, reserved: int, used: int) -> None:
        if not limits.tpm or reserved == used:
            return
        try:
            await self._settle(keys=self._keys(subject)[1:], args=[limits.tpm, reserved - used])
        except (RedisError, OSError) as exc:
            raise RateLimiterUnavailable(str(exc)) from None
