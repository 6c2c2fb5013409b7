"""What keeps the request path short: the counters' pipelined Redis connection (batched, in
order, NOSCRIPT survived), the refresh-ahead key and catalog cache, the ledger writer's batches,
and the settlement that runs after the response yet is never lost at shutdown."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from loraplex.billing.ledger import LedgerWriter
from loraplex.billing.redis_pipe import ScriptPipe
from loraplex.billing.spool import Spool
from loraplex.billing.tail import Tail
from loraplex.billing.usage import UsageEvent
from loraplex.platform.admission import Admission
from loraplex.platform.cache import RefreshingCache
from tests.integration.billing_support import (
    FAKE_MODEL,
    ScriptedEngine,
    app_client,
    assert_counters_match_ledger,
    complete,
    new_tenant,
    set_budget,
)
from tests.integration.conftest import REDIS_URL, run

_APPEND = "redis.call('RPUSH', KEYS[1], ARGV[1]); return redis.call('LLEN', KEYS[1])"


def test_pipe_batches_concurrent_calls_and_keeps_their_order(redis_prefix):
    async def main():
        client = Redis.from_url(REDIS_URL, decode_responses=True)
        pipe = ScriptPipe(client, {"append": _APPEND})
        key = f"{redis_prefix}pipe-{secrets.token_hex(3)}"
        await client.script_load(_APPEND)  # a fresh Redis would answer NOSCRIPT first: a second trip
        try:
            round_trips = 0
            exchange = pipe._exchange

            async def counted(batch):
                nonlocal round_trips
                round_trips += 1
                return await exchange(batch)

            pipe._exchange = counted
            replies = await asyncio.gather(*(pipe.script("append", [key], [i]) for i in range(50)))
            batched = round_trips
            stored = await client.lrange(key, 0, -1)
            with pytest.raises(ResponseError):  # an error reply fails its own call only
                await pipe.command("INCR", key)
            after = await pipe.script("append", [key], ["last"])
        finally:
            await client.delete(key)
            await pipe.close()
            await client.aclose()
        return replies, stored, batched, after

    replies, stored, batched, after = run(main())
    assert replies == list(range(1, 51)) and stored == [str(i) for i in range(50)]
    assert batched == 1  # queued together before the writer ran: one send, one read
    assert after == 51


def test_pipe_loads_a_script_redis_does_not_know_and_runs_each_call_once(redis_prefix):
    """NOSCRIPT (Redis restarted or its scripts flushed): the calls did not run; they run once
    the script is loaded, in their order. A script no other run uses stands for a flushed one."""
    async def main():
        client = Redis.from_url(REDIS_URL, decode_responses=True)
        pipe = ScriptPipe(client, {"append": f"{_APPEND} -- {secrets.token_hex(8)}"})
        key = f"{redis_prefix}noscript-{secrets.token_hex(3)}"
        try:
            replies = await asyncio.gather(*(pipe.script("append", [key], [x]) for x in "abc"))
            return replies, await client.lrange(key, 0, -1)
        finally:
            await client.delete(key)
            await pipe.close()
            await client.aclose()

    assert run(main()) == ([1, 2, 3], ["a", "b", "c"])


def test_refreshing_cache_rereads_entries_in_use_before_they_expire():
    now = [0.0]
    reads: list[int] = []

    async def main():
        gate = asyncio.Event()

        async def load(key: str) -> int:
            reads.append(len(reads))
            if len(reads) == 2:
                await gate.wait()
            return len(reads)

        cache = RefreshingCache(load, ttl_s=1.0, what="test", clock=lambda: now[0])
        first = await cache.get("k")  # a miss is read in line
        now[0] = 0.8  # past 3/4 of the TTL: served from the entry, one read starts behind it
        served = [await cache.get("k"), await cache.get("k")]
        await asyncio.sleep(0)
        started = len(reads)
        gate.set()
        await asyncio.sleep(0.01)
        now[0] = 1.5  # the first entry would have expired: the background read replaced it
        refreshed = await cache.get("k")
        now[0] = 2.8  # older than the TTL, nobody used it: read in line
        expired = await cache.get("k")
        cache.invalidate()
        return first, served, started, refreshed, expired, await cache.get("k")

    first, served, started, refreshed, expired, after_invalidate = asyncio.run(main())
    assert first == 1 and served == [1, 1] and started == 2  # one background read, not two
    assert refreshed == 2 and expired == 3 and after_invalidate == 4


def _event(i: int) -> UsageEvent:
    return UsageEvent(f"req_{secrets.token_hex(8)}", 1, "t", 1, "lpx-x", FAKE_MODEL, None, "standard", 1, 0, i, None,
                      0.001, "ok", "stop")


def test_a_ledger_flush_writes_what_was_queued_not_what_arrives_meanwhile(tmp_path, monkeypatch):
    """Chasing each write with the next would keep the writer busy in tiny batches under load."""
    written: list[int] = []

    async def slow_write(db, events):
        written.append(len(events))
        if len(written) <= 2:
            writer.emit(_event(0))  # a request ends while the batch is being written
        await asyncio.sleep(0)
        return {e.request_id: i for i, e in enumerate(events)}

    monkeypatch.setattr("loraplex.billing.ledger.write_events", slow_write)
    writer = LedgerWriter(None, Spool(tmp_path, "t"), Tail(), batch_size=100, flush_interval_s=3600)

    async def main():
        writer.start()
        for i in range(3):
            writer.emit(_event(i))
        await writer.flush()
        after_flush = (list(written), writer.queue_depth)
        await writer.close()  # a normal stop writes everything, also what arrives during it
        return after_flush

    assert asyncio.run(main()) == ([3], 1)
    assert written == [3, 1, 1] and writer.queue_depth == 0 and writer.events_spooled == 0


def test_settlement_after_the_response_is_finished_at_shutdown(postgres_backend, monkeypatch):
    settle = Admission.settle

    async def slow_settle(self, ticket, used):
        await asyncio.sleep(0.3)  # still running when the app is told to stop
        await settle(self, ticket, used)

    with app_client(postgres_backend, ScriptedEngine("stop", tokens=3)) as setup:
        tenant, tenant_id, key = new_tenant(setup, "late")
        set_budget(setup, tenant, 1000)
    monkeypatch.setattr(Admission, "settle", slow_settle)
    with app_client(postgres_backend, ScriptedEngine("stop", tokens=3)) as client:
        for stream in (False, True):
            assert complete(client, key, FAKE_MODEL, max_tokens=50, stream=stream).status_code == 200
    monkeypatch.setattr(Admission, "settle", settle)
    with app_client(postgres_backend, ScriptedEngine("stop", tokens=3)) as after:
        rows = assert_counters_match_ledger(after, tenant, tenant_id)
    assert [(r.status, r.completion_tokens) for r in rows] == [("ok", 3)] * 2
