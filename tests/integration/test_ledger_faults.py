"""The usage ledger under faults, against real Postgres: events the database refuses are
quarantined while the rest of their batch lands and later replays go on; a spool that cannot be
written keeps the events in memory until it can; outages and refusals are told apart; and while
the database drops packets, requests with cached keys are served within seconds."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime

from sqlalchemy import select

from loraplex.billing.db_errors import is_outage, is_refusal
from loraplex.billing.ledger import LedgerWriter
from loraplex.billing.ledger_db import write_events
from loraplex.billing.spool import QUARANTINE, Spool
from loraplex.billing.tables import usage_ledger
from loraplex.billing.tail import Tail
from loraplex.billing.usage import UsageEvent
from loraplex.platform.db.database import make_engine
from tests.integration.billing_support import (
    app_client,
    complete,
    flush,
    ledger_rows,
    new_tenant,
    platform_of,
)
from tests.integration.tcp_proxy import through

TENANT = 990_000  # no real tenant has it: these rows are this module's own


def _event(request_id: str, **changes) -> UsageEvent:
    values = dict(request_id=request_id, tenant_id=TENANT, tenant="faults", key_id=1, key_prefix="lpx-x",
                  model="synthetic:tiny", adapter=None, priority="standard", prompt_tokens=3, cached_tokens=0,
                  completion_tokens=2, ttft_s=0.01, latency_s=0.1, status="ok", finish_reason="stop",
                  created_at=datetime.now(UTC))
    return UsageEvent(**{**values, **changes})


# Each of these the database refuses for its content, each in its own way.
REFUSED = {
    "too_long": {"model": "m" * 201},  # String(200): SQLSTATE 22001
    "out_of_range": {"key_id": 2**31},  # Integer: asyncpg cannot encode it, SQLSTATE 22000
    "negative": {"prompt_tokens": -1},  # ck_usage_ledger_tokens: SQLSTATE 23514
}


def _ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


async def _in_ledger(db, request_ids: list[str]) -> set[str]:
    async with db.connect() as conn:
        query = select(usage_ledger.c.request_id).where(usage_ledger.c.request_id.in_(request_ids))
        return set((await conn.execute(query)).scalars())


def _quarantined(directory) -> list[dict]:
    path = directory / QUARANTINE
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def test_refused_events_are_quarantined_and_the_rest_of_their_batch_lands(pg_url, tmp_path):
    tag = f"q{time.time_ns()}"
    good = [_event(i) for i in _ids(tag, 9)]
    bad = [_event(f"{tag}-{name}", **change) for name, change in REFUSED.items()]

    async def main():
        db = make_engine(pg_url)
        writer = LedgerWriter(db, Spool(tmp_path, "w"), Tail(), batch_size=50, flush_interval_s=3600)
        try:
            writer.start()
            for e in good[:4] + bad + good[4:]:
                writer.emit(e)
            await writer.flush()
            await writer.flush()  # nothing is tried, nor quarantined, twice
            landed = await _in_ledger(db, [e.request_id for e in good + bad])
            return landed, writer.events_quarantined, writer.queue_depth, writer.spool.empty, writer.down
        finally:
            await writer.close()
            await db.dispose()

    landed, quarantined, depth, spool_empty, down = asyncio.run(main())
    assert landed == {e.request_id for e in good}
    assert quarantined == len(bad) and depth == 0 and spool_empty and not down
    kept = _quarantined(tmp_path)
    assert sorted(q["event"]["request_id"] for q in kept) == sorted(e.request_id for e in bad)
    assert all(q["error"] for q in kept)
    assert UsageEvent.from_json(kept[0]["event"]).tenant_id == TENANT  # kept whole, to be fixed and replayed


def test_a_poisoned_spool_file_does_not_block_the_replay_of_the_rest(pg_url, tmp_path):
    """A stopped process left two files: the first holds a refused event among good ones."""
    tag = f"p{time.time_ns()}"
    first = [_event(i) for i in _ids(tag + "a", 5)]
    first.insert(2, _event(f"{tag}-bad", model="x" * 300))
    second = [_event(i) for i in _ids(tag + "b", 4)]
    left = Spool(tmp_path, "stopped")
    left.append(first)
    left.close()
    (tmp_path / "ledger-stopped.jsonl").rename(tmp_path / "replay-stopped-1.jsonl")
    later = Spool(tmp_path, "stopped2")
    later.append(second)
    later.close()

    async def main():
        db = make_engine(pg_url)
        writer = LedgerWriter(db, Spool(tmp_path, "w"), Tail(), batch_size=4, flush_interval_s=3600)
        try:
            recovered = writer.start()
            await writer.flush()
            landed = await _in_ledger(db, [e.request_id for e in first + second])
            return len(recovered), landed, writer.events_quarantined, writer.spool.empty
        finally:
            await writer.close()
            await db.dispose()

    recovered, landed, quarantined, spool_empty = asyncio.run(main())
    assert recovered == len(first) + len(second)
    assert landed == {e.request_id for e in first + second if e.request_id != f"{tag}-bad"}
    assert quarantined == 1 and spool_empty
    assert [q["event"]["request_id"] for q in _quarantined(tmp_path)] == [f"{tag}-bad"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [QUARANTINE]


def test_outages_and_refusals_are_told_apart(pg_url, sqlite_url, proxy):
    async def error_of(url: str, events: list[UsageEvent]) -> BaseException:
        db = make_engine(url, connect_timeout_s=1.0)
        try:
            await write_events(db, events)
        except Exception as exc:
            return exc
        finally:
            await db.dispose()
        raise AssertionError("the write succeeded")

    tag = f"c{time.time_ns()}"
    for name, change in REFUSED.items():
        exc = asyncio.run(error_of(pg_url, [_event(f"{tag}-{name}", **change)]))
        assert is_refusal(exc) and not is_outage(exc), (name, exc)
    for change in ({"prompt_tokens": -1}, {"key_id": 2**63}):  # SQLite: a failed check, an int beyond int8
        exc = asyncio.run(error_of(sqlite_url, [_event(f"{tag}-sqlite", **change)]))
        assert is_refusal(exc) and not is_outage(exc), (change, exc)
    proxy.down()  # refused connections
    exc = asyncio.run(error_of(through(pg_url, proxy), [_event(f"{tag}-down")]))
    assert is_outage(exc) and not is_refusal(exc), exc
    proxy.blackhole()  # dropped packets: the connect timeout ends it
    started = time.monotonic()
    exc = asyncio.run(error_of(through(pg_url, proxy), [_event(f"{tag}-silent")]))
    assert is_outage(exc) and not is_refusal(exc), exc
    assert time.monotonic() - started < 10
    assert not is_outage(RuntimeError("a bug")) and not is_refusal(RuntimeError("a bug"))


def test_a_spool_that_cannot_be_written_keeps_the_events_until_it_can(postgres_backend, pg_url, proxy, tmp_path):
    """The database is down and the spool's directory is a plain file (so every open fails, as on
    a broken disk): the events stay in memory; once the spool can be written they go there, and
    once the database is back they land, each once."""
    with app_client(postgres_backend, database_url=through(pg_url, proxy), data_dir=tmp_path) as client:
        ledger = platform_of(client).ledger
        tenant, tenant_id, key = new_tenant(client, "spoolfail")
        assert complete(client, key).status_code == 200
        flush(client)
        (tmp_path / "spool").write_text("not a directory")
        proxy.down()
        served = [complete(client, key) for _ in range(3)]
        assert all(r.status_code == 200 for r in served), [r.text for r in served]
        flush(client)
        assert ledger.down and ledger.spool_down and ledger.spool_failures >= 1
        assert ledger.queue_depth == 3 and ledger.events_dropped == 0
        (tmp_path / "spool").unlink()  # the disk is fixed
        deadline = time.monotonic() + 30
        while ledger.queue_depth:
            assert time.monotonic() < deadline, "the held events never reached the spool"
            time.sleep(0.2)
            flush(client)
        assert ledger.spool.events == 3 and not ledger.spool_down
        proxy.up()
        deadline = time.monotonic() + 30
        while not (ledger.spool.empty and not ledger.down):
            assert time.monotonic() < deadline, "the spool was not replayed"
            time.sleep(0.2)
            flush(client)
        rows = ledger_rows(postgres_backend.settings, tenant_id)
        assert len(rows) == 4 and {r.request_id for r in rows} >= {r.headers["x-request-id"] for r in served}


def test_cached_keys_keep_serving_while_the_database_drops_packets(postgres_backend, pg_url, proxy, tmp_path):
    """An outage that drops packets, not one that refuses them: requests whose key and model are
    cached are served within seconds, not after asyncpg's minute, and their usage lands later."""
    with app_client(postgres_backend, database_url=through(pg_url, proxy), data_dir=tmp_path) as client:
        tenant, tenant_id, key = new_tenant(client, "blackhole")
        assert complete(client, key).status_code == 200
        flush(client)
        proxy.blackhole()
        time.sleep(2.5)  # past the key's (0.5 s) and the catalog's (2 s) cache lifetimes
        served = []
        for _ in range(3):
            started = time.monotonic()
            r = complete(client, key)
            assert r.status_code == 200, r.text
            assert time.monotonic() - started < 10, "a request waited on the silent database"
            served.append(r.headers["x-request-id"])
        proxy.up()
        ledger = platform_of(client).ledger
        deadline = time.monotonic() + 60
        while True:
            flush(client)
            rows = {r.request_id for r in ledger_rows(postgres_backend.settings, tenant_id)}
            if set(served) <= rows and ledger.spool.empty:
                break
            assert time.monotonic() < deadline, "the usage of the outage never landed"
            time.sleep(0.2)
        assert len(rows) == 4
