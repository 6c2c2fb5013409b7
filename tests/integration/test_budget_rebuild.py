"""Redis holds counters only; the ledger is the truth. Counters lost mid-period (Redis flushed or
restarted, a process dead with reservations) are rebuilt from the ledger before anything is
admitted, every process adds back what the ledger cannot know yet, and a tenant over budget
stays over budget."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from loraplex.billing.budgets import BudgetRule, counter_name
from loraplex.billing.counters import MemoryCounters
from loraplex.billing.quota import AdmitRequest, Quota
from loraplex.billing.rebuild import tenant_usage
from loraplex.billing.redis_counters import RedisCounters
from loraplex.billing.tail import Tail
from loraplex.platform.db.database import make_engine
from tests.integration.billing_support import (
    ADMIN,
    FAKE_MODEL,
    ScriptedEngine,
    app_client,
    assert_counters_match_ledger,
    complete,
    flush,
    new_tenant,
    platform_of,
    set_budget,
)
from tests.integration.conftest import REDIS_URL, delete_redis_prefix, run


def flush_redis(backend) -> None:
    """FLUSHALL for this run's keys (other runs may share the Redis server)."""
    run(delete_redis_prefix(REDIS_URL, backend.settings.redis_prefix))


def test_flushed_redis_is_rebuilt_from_the_ledger_and_the_tenant_stays_over_budget(postgres_backend):
    with app_client(postgres_backend) as a, app_client(postgres_backend) as b:
        tenant, tenant_id, key = new_tenant(a, "flushed")
        set_budget(a, tenant, 100)
        while complete(a, key, max_tokens=10).status_code == 200:
            pass
        flush(a)
        rebuilds = platform_of(a).quota.rebuilds + platform_of(b).quota.rebuilds
        flush_redis(postgres_backend)
        for client in (a, b, a):
            refused = complete(client, key, max_tokens=10)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
        assert platform_of(a).quota.rebuilds + platform_of(b).quota.rebuilds == rebuilds + 1  # once, not per request
        assert_counters_match_ledger(a, tenant, tenant_id)
        assert "loraplex_budget_counter_rebuilds_total" in a.get("/metrics", headers=ADMIN).text


def _until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_flush_with_requests_in_flight_and_usage_not_yet_written_loses_and_doubles_nothing(postgres_backend):
    engine = ScriptedEngine("stop", tokens=4)
    slow = {"ledger_flush_interval_s": 3600.0}  # usage stays queued until flush() says otherwise
    with app_client(postgres_backend, engine, **slow) as a, app_client(postgres_backend, engine, **slow) as b:
        tenant, tenant_id, key = new_tenant(a, "inflight")
        set_budget(a, tenant, 10_000)
        assert complete(a, key, FAKE_MODEL).status_code == 200
        flush(a)  # in the ledger
        assert complete(a, key, FAKE_MODEL).status_code == 200  # settled, not in the ledger yet
        engine.gate.clear()
        with ThreadPoolExecutor(max_workers=8) as pool:
            held = [pool.submit(complete, (a, b)[i % 2], key, FAKE_MODEL, max_tokens=30) for i in range(6)]
            _until(lambda: engine.waiting == 6, "6 requests in flight")
            flush_redis(postgres_backend)
            rebuilder = threading.Thread(target=lambda: complete(b, key, FAKE_MODEL, max_tokens=30))
            rebuilder.start()  # b rebuilds; a adopts on its own
            _until(lambda: engine.waiting == 7, "the request after the flush")
            engine.gate.set()
            rebuilder.join()
            assert [f.result().status_code for f in held] == [200] * 6
        flush(a, b)
        rows = assert_counters_match_ledger(a, tenant, tenant_id)
        assert len(rows) == 9 and len({r.request_id for r in rows}) == 9
        assert_counters_match_ledger(b, tenant, tenant_id)


def test_reservations_of_a_dead_process_are_cleared_by_a_rebuild(pg_url, redis_prefix):
    """A process that stops without settling (killed) leaves reservations in Redis; the others
    notice its silent heartbeat, bump the generation, and rebuild from the ledger."""
    now = datetime.now(UTC)
    tenant_id = 10_000_000 + secrets.randbelow(1_000_000)  # no ledger rows: it has used nothing
    rules = (BudgetRule("tenant", "month", 150),)
    month = counter_name("t", "month", now)

    async def scenario():
        db = make_engine(pg_url)
        prefix = f"{redis_prefix}dead-{secrets.token_hex(2)}:"  # its own processes only
        quotas = [Quota(RedisCounters.from_url(REDIS_URL, prefix, dead_after_s=0.5), Tail(),
                        lambda t, n: tenant_usage(db, t, n), instance=name) for name in ("doomed", "survivor")]
        doomed, survivor = quotas
        try:
            for q in quotas:
                await q.reconcile()

            def req(n):
                return AdmitRequest(f"req_dead_{n}_{secrets.token_hex(4)}", tenant_id, 1, now, 100, rules)

            assert (await doomed.admit(req(1))).charge is not None  # then it dies with 100 reserved
            assert (await survivor.admit(req(2))).refused == "quota"
            await asyncio.sleep(0.7)
            await survivor.reconcile()  # finds `doomed` silent
            admitted = await survivor.admit(req(3))
            counters = await survivor.read(tenant_id, (month,))
        finally:
            for q in quotas:
                await q.close()
            await db.dispose()
        return admitted, counters

    admitted, counters = run(scenario())
    assert admitted.charge is not None and counters[month] == (0, 100)


def test_adoption_adds_back_exactly_what_the_rebuild_could_not_see():
    """In process: a charge the ledger holds below the mark is not added again; one committed
    after the mark, one not yet written and one in flight are."""
    now = datetime.now(UTC)
    ledger = {"hwm": 0, "used": 0}
    month = counter_name("t", "month", now)

    async def usage(tenant_id, at):
        return ledger["hwm"], {month: ledger["used"]}

    async def scenario():
        store, tail = MemoryCounters(), Tail()
        quota = Quota(store, tail, usage)
        charges = []
        for i in range(4):
            verdict = await quota.admit(AdmitRequest(f"r{i}", 7, 1, now, 50))
            charges.append(verdict.charge)
        for c in charges[:3]:
            await quota.settle(c, 20)  # the fourth stays in flight with 50 reserved
        tail.committed({"r0": 1, "r1": 2})  # r2 settled but not written
        ledger.update(hwm=1, used=20)  # the rebuild sees r0 only; r1 was committed after it
        await store.invalidate(7)
        await quota.admit(AdmitRequest("r4", 7, 1, now, 10))
        return await quota.read(7, (month,)), {c.request_id for c in tail.of(7)}

    counters, remaining = asyncio.run(scenario())
    assert counters[month] == (20 + 20 + 20, 50 + 10)  # r0 from the ledger, r1 and r2 added; r3, r4 reserved
    assert remaining == {"r1", "r2", "r3", "r4"}  # r0 is the ledger's now
