"""RPM/TPM buckets in Redis, shared by every app instance; each operation is one Lua script.

The script reads the clock with Redis TIME, so instances with skewed clocks agree. A bucket is a
hash {l: level, t: time}; it expires once it would be full again, and a missing bucket is full.
Both keys of a subject share a hash tag, so the script also works on a Redis cluster.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import RedisError

from loraplex.billing.ratelimit import Decision, Limits, RateLimiterUnavailable, window

_COMMON = """
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

# KEYS: request bucket, token bucket. ARGV: rpm (0 = none), tpm (0 = none), tokens.
# Returns {allowed, request level, token level, seconds to wait, tokens reserved}.
ACQUIRE = _COMMON + """
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local cost = 0
local lr, lt, wait = -1, -1, 0
if rpm > 0 then
  lr = level(KEYS[1], rpm)
  wait = math.max(wait, (1 - lr) * 60 / rpm)
end
if tpm > 0 then
  cost = math.min(tonumber(ARGV[3]), tpm)
  lt = level(KEYS[2], tpm)
  wait = math.max(wait, (cost - lt) * 60 / tpm)
end
local ok = wait <= 0
if ok then
  if rpm > 0 then lr = lr - 1; save(KEYS[1], lr, rpm) end
  if tpm > 0 then lt = lt - cost; save(KEYS[2], lt, tpm) end
else
  cost = 0
end
return {ok and 1 or 0, tostring(lr), tostring(lt), tostring(math.max(wait, 0)), cost}
"""

# KEYS: token bucket. ARGV: tpm, tokens to give back (negative: a debt).
SETTLE = _COMMON + """
local tpm = tonumber(ARGV[1])
save(KEYS[1], math.min(tpm, level(KEYS[1], tpm) + tonumber(ARGV[2])), tpm)
return 1
"""


class RedisRateLimiter:
    def __init__(self, client: Redis, prefix: str = "loraplex:"):
        self._client = client
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
        return Decision(
            allowed=bool(ok),
            requests=window(limits.rpm, float(lr)) if limits.rpm else None,
            tokens=window(limits.tpm, float(lt)) if limits.tpm else None,
            retry_after_s=float(wait), reserved_tokens=int(cost))

    async def settle(self, subject: str, limits: Limits, reserved: int, used: int) -> None:
        if not limits.tpm or reserved == used:
            return
        try:
            await self._settle(keys=self._keys(subject)[1:], args=[limits.tpm, reserved - used])
        except (RedisError, OSError) as exc:
            raise RateLimiterUnavailable(str(exc)) from None

    async def ping(self) -> bool:
        try:
            return bool(await self._client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._client.aclose()
