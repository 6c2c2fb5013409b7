"""Budget counters and RPM/TPM buckets in Redis, so that admission is one atomic round trip across app instances.

- Every operation is one Lua script: admission checks and reserves both buckets and all six budget counters at once.
- Keys, with `P` the prefix and `T` the tenant id:
    P gen                     the generation; bumped when a process dies (see heartbeat)
    P instances               hash: process -> last heartbeat (Redis clock, ms)
    P{tT}:epoch               the tenant's marker "<gen>|<epoch id>|<hwm>", expires after EPOCH_TTL_S
    P{tT}:rebuilding          lock of the process rebuilding the tenant's counters
    P{tT}:c:<epoch id>        hash of the epoch's counters: fields "<name>:u" (used), "<name>:r"
                              (reserved); a new epoch has a new hash, the old one expires
    P{tT}:rl:k<key>:req|tok   the key's RPM/TPM buckets
- Counter names and limits travel as one space-separated argument each, and admission and settlement answer with
  one space-separated string: on the hot path, a call costs mostly the arguments and reply elements packed and parsed.
- Every call goes through one pipelined connection (redis_pipe.py): concurrent calls share a round trip, and Redis
  runs this process's calls in the order they were made.
- One Redis server (or a primary with replicas), not a cluster: a tenant's keys share a hash tag, `gen` and
  `instances` do not.
- Redis must not evict keys (maxmemory-policy noeviction): counters evicted inside a live epoch would read as zero.
"""

from __future__ import annotations

import secrets

from redis.asyncio import Redis
from redis.exceptions import RedisError

from loraplex.billing.counters import EPOCH_TTL_S, MISSING, REBUILD_LOCK_S, CountersUnavailable, Outcome
from loraplex.billing.ratelimit import Limits
from loraplex.billing.redis_pipe import ScriptPipe
from loraplex.billing.redis_ratelimit import BUCKETS, COMMON, RedisStore, decision
from loraplex.billing.tail import Charge

# KEYS[1] = generation, KEYS[2] = the tenant's marker; ARGV[1] = the marker the caller holds.
_EPOCH = """
local function problem()
  local g = redis.call('GET', KEYS[1])
  local m = redis.call('GET', KEYS[2])
  if not g or not m or string.sub(m, 1, #g + 1) ~= g .. '|' then return 'missing' end
  if m ~= ARGV[1] then return 'stale ' .. m end
  return false
end
local function keep(key)  -- the counters live a day longer than their epoch
  redis.call('PEXPIRE', key, math.max(redis.call('PTTL', KEYS[2]), 0) + 86400000)
end
local function words(text)
  local out = {}
  for w in string.gmatch(text, '%S+') do out[#out + 1] = w end
  return out
end
"""

# KEYS: gen, marker, request bucket, token bucket, counters. ARGV: marker, rpm, tpm, rate tokens,
# reservation, counter names, their limits (0: none).
ADMIT = COMMON + BUCKETS + _EPOCH + """
local bad = problem()
if bad then return bad end
local reserve = tonumber(ARGV[5])
local names, limits = words(ARGV[6]), words(ARGV[7])
for i, name in ipairs(names) do
  local limit = tonumber(limits[i])
  if limit > 0 then
    local c = redis.call('HMGET', KEYS[5], name .. ':u', name .. ':r')
    local held = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0)
    if held + reserve > limit then return 'quota ' .. (i - 1) .. ' ' .. held end
  end
end
local r = take(KEYS[3], KEYS[4], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]))
if r[1] == 0 then return table.concat({'rate', r[2], r[3], r[4]}, ' ') end
for _, name in ipairs(names) do redis.call('HINCRBY', KEYS[5], name .. ':r', reserve) end
if redis.call('PTTL', KEYS[5]) < 0 then keep(KEYS[5]) end  -- once per epoch: settle never creates it
return table.concat({'ok', r[2], r[3], r[4], r[5]}, ' ')
"""

# KEYS: gen, marker, token bucket, counters. ARGV: marker, tpm, tokens back to the bucket,
# reservation, tokens used, counter names. Returns each counter's tokens used, after.
SETTLE = COMMON + BUCKETS + _EPOCH + """
local bad = problem()
if bad then return bad end
local tpm, refund = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and refund ~= 0 then give(KEYS[3], tpm, refund) end
local out = {'ok'}
for _, name in ipairs(words(ARGV[6])) do
  redis.call('HINCRBY', KEYS[4], name .. ':r', -tonumber(ARGV[4]))
  out[#out + 1] = redis.call('HINCRBY', KEYS[4], name .. ':u', tonumber(ARGV[5]))
end
return table.concat(out, ' ')
"""

# KEYS: gen, marker, counters. ARGV: marker, then (name, reserved, used) per counter.
ADOPT = _EPOCH + """
local bad = problem()
if bad then return {bad} end
for i = 2, #ARGV, 3 do
  redis.call('HINCRBY', KEYS[3], ARGV[i] .. ':r', tonumber(ARGV[i + 1]))
  redis.call('HINCRBY', KEYS[3], ARGV[i] .. ':u', tonumber(ARGV[i + 2]))
end
keep(KEYS[3])
return {'ok'}
"""

# KEYS: gen, marker, counters. ARGV: marker, counter names. Returns {'ok', u1, r1, u2, r2, ...}.
READ = _EPOCH + """
local bad = problem()
if bad then return {bad} end
local out = {'ok'}
for _, name in ipairs(words(ARGV[2])) do
  local c = redis.call('HMGET', KEYS[3], name .. ':u', name .. ':r')
  out[#out + 1] = tonumber(c[1]) or 0
  out[#out + 1] = tonumber(c[2]) or 0
end
return out
"""

# KEYS: gen, marker. Returns the marker if it belongs to the current generation, else false.
MARKER = """
local g = redis.call('GET', KEYS[1])
local m = redis.call('GET', KEYS[2])
if g and m and string.sub(m, 1, #g + 1) == g .. '|' then return m end
return false
"""

# KEYS: gen, marker, lock. ARGV: token, a generation to start if there is none, lock ms.
BEGIN_REBUILD = """
local g = redis.call('GET', KEYS[1])
if not g then redis.call('SET', KEYS[1], ARGV[2]); g = ARGV[2] end
local m = redis.call('GET', KEYS[2])
if m and string.sub(m, 1, #g + 1) == g .. '|' then return {'exists', m} end
if not redis.call('SET', KEYS[3], ARGV[1], 'NX', 'PX', ARGV[3]) then return {'busy'} end
return {'ok', g}
"""

# KEYS: gen, marker, lock, counters. ARGV: token, new marker, epoch ms, then (name, used) pairs.
FINISH_REBUILD = _EPOCH + """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[3])
local g = redis.call('GET', KEYS[1])
if not g or string.sub(ARGV[2], 1, #g + 1) ~= g .. '|' then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[4])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[4], ARGV[i] .. ':u', ARGV[i + 1]) end
keep(KEYS[4])
return 1
"""

# KEYS: instances, gen. ARGV: this process, ms after which a silent process is dead, a fresh
# generation, 1 when leaving. Returns how many dead processes it removed.
HEARTBEAT = """
if ARGV[4] == '1' then redis.call('HDEL', KEYS[1], ARGV[1]); return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], now)
local all = redis.call('HGETALL', KEYS[1])
local dead = 0
for i = 1, #all, 2 do
  if now - tonumber(all[i + 1]) > tonumber(ARGV[2]) then
    redis.call('HDEL', KEYS[1], all[i])
    dead = dead + 1
  end
end
if dead > 0 then redis.call('SET', KEYS[2], ARGV[3]) end
return dead
"""

_SCRIPTS = {"admit": ADMIT, "settle": SETTLE, "adopt": ADOPT, "read": READ, "marker": MARKER,
            "begin_rebuild": BEGIN_REBUILD, "finish_rebuild": FINISH_REBUILD, "heartbeat": HEARTBEAT}


def _epoch_id(marker: str) -> str:
    return marker.split("|")[1] if marker.count("|") == 2 else "none"


class RedisCounters(RedisStore):
    def __init__(self, client: Redis, prefix: str = "loraplex:", dead_after_s: float = 30.0,
                 timeout_s: float | None = 0.5):
        super().__init__(client)
        self._prefix = prefix
        self._dead_ms = int(dead_after_s * 1000)
        self._pipe = ScriptPipe(client, _SCRIPTS, timeout_s)

    @classmethod
    def from_url(cls, url: str, prefix: str = "loraplex:", timeout_s: float = 0.5, **kwargs) -> RedisCounters:
        client = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True)
        return cls(client, prefix, timeout_s=timeout_s, **kwargs)

    def _tenant(self, tenant_id: int) -> str:
        return f"{self._prefix}{{t{tenant_id}}}"

    def _head(self, tenant_id: int) -> list[str]:
        return [f"{self._prefix}gen", f"{self._tenant(tenant_id)}:epoch"]

    def _counters(self, tenant_id: int, marker: str) -> str:
        return f"{self._tenant(tenant_id)}:c:{_epoch_id(marker)}"

    def _buckets(self, tenant_id: int, key_id: int) -> list[str]:
        base = f"{self._tenant(tenant_id)}:rl:k{key_id}"
        return [f"{base}:req", f"{base}:tok"]

    async def _run(self, name: str, keys: list[str], args: list) -> object:
        try:
            return await self._pipe.script(name, keys, args)
        except (RedisError, OSError) as exc:
            raise CountersUnavailable(f"Redis: {exc}") from None

    @staticmethod
    def _problem(text: str) -> Outcome | None:
        """Outcome of "missing" or "stale <marker>" from an epoch check; None for anything else."""
        status, _, marker = text.partition(" ")
        if status == "missing":
            return MISSING
        return Outcome("stale", marker) if status == "stale" else None

    async def admit(self, tenant_id: int, marker: str, charge: Charge, limits: tuple[int, ...], rate: Limits,
                    rate_tokens: int) -> Outcome:
        keys = [*self._head(tenant_id), *self._buckets(tenant_id, charge.key_id), self._counters(tenant_id, marker)]
        reply = await self._run("admit", keys, [marker, rate.rpm or 0, rate.tpm or 0, max(0, rate_tokens),
                                                charge.reserved, " ".join(charge.counters),
                                                " ".join(map(str, limits))])
        problem = self._problem(reply)
        reply = reply.split(" ")
        if problem:
            return problem
        if reply[0] == "quota":
            return Outcome("quota", refused=int(reply[1]), held=int(reply[2]))
        if reply[0] == "rate":
            return Outcome("rate", decision=decision(rate, 0, *reply[1:4]))
        return Outcome("ok", decision=decision(rate, 1, *reply[1:5]))

    async def settle(self, tenant_id: int, marker: str, charge: Charge, used: int) -> Outcome:
        keys = [*self._head(tenant_id), self._buckets(tenant_id, charge.key_id)[1], self._counters(tenant_id, marker)]
        reply = await self._run("settle", keys, [marker, charge.tpm, charge.tpm_reserved - used, charge.reserved,
                                                 used, " ".join(charge.counters)])
        return self._problem(reply) or Outcome("ok", used=tuple(int(u) for u in reply.split(" ")[1:]))

    async def adopt(self, tenant_id: int, marker: str, deltas: dict[str, tuple[int, int]]) -> Outcome:
        args = [marker] + [v for name in sorted(deltas) for v in (name, *deltas[name])]
        reply = await self._run("adopt", [*self._head(tenant_id), self._counters(tenant_id, marker)], args)
        return self._problem(reply[0]) or Outcome("ok")

    async def marker(self, tenant_id: int) -> str | None:
        return await self._run("marker", self._head(tenant_id), []) or None

    async def begin_rebuild(self, tenant_id: int, token: str) -> Outcome:
        keys = self._head(tenant_id) + [f"{self._tenant(tenant_id)}:rebuilding"]
        reply = await self._run("begin_rebuild", keys, [token, secrets.token_hex(4), int(REBUILD_LOCK_S * 1000)])
        return Outcome(reply[0], reply[1] if len(reply) > 1 else None)

    async def finish_rebuild(self, tenant_id: int, token: str, marker: str, used: dict[str, int]) -> bool:
        keys = [*self._head(tenant_id), f"{self._tenant(tenant_id)}:rebuilding", self._counters(tenant_id, marker)]
        args = [token, marker, int(EPOCH_TTL_S * 1000)] + [v for n in sorted(used) if used[n] for v in (n, used[n])]
        return bool(await self._run("finish_rebuild", keys, args))

    async def invalidate(self, tenant_id: int) -> None:
        try:
            await self._pipe.command("DEL", self._head(tenant_id)[1])
        except (RedisError, OSError) as exc:
            raise CountersUnavailable(f"Redis: {exc}") from None

    async def heartbeat(self, instance: str, leaving: bool = False) -> int:
        keys = [f"{self._prefix}instances", f"{self._prefix}gen"]
        return int(await self._run("heartbeat", keys, [instance, self._dead_ms, secrets.token_hex(4),
                                                       1 if leaving else 0]))

    async def close(self) -> None:
        await self._pipe.close()
        await super().close()

    async def read(self, tenant_id: int, marker: str,
                   counters: tuple[str, ...]) -> dict[str, tuple[int, int]] | None:
        reply = await self._run("read", [*self._head(tenant_id), self._counters(tenant_id, marker)],
                                [marker, " ".join(counters)])
        if reply[0] != "ok":
            return None
        values = [int(v) for v in reply[1:]]
        return {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(counters)}
