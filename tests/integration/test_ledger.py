"""The usage ledger: one row per request whatever happens to the database. While it is down,
requests are served (or refused, as configured) and usage goes to the durable spool; once it is
back, the spool is replayed and every request appears exactly once, in the rows and the rollups.
A spool left by a stopped process is replayed by the next one, also exactly once."""

from __future__ import annotations

import dataclasses
import time

import pytest
from sqlalchemy.engine import make_url

from loraplex.billing.ledger_db import write_events
from loraplex.billing.spool import Spool
from loraplex.billing.usage import UsageEvent
from tests.integration.billing_support import (
    ADMIN,
    app_client,
    assert_counters_match_ledger,
    complete,
    flush,
    ledger_rows,
    new_tenant,
    platform_of,
    rollup_tokens,
    set_budget,
    tokens,
    with_db,
)
from tests.integration.tcp_proxy import TcpProxy


def _through(pg_url: str, proxy: TcpProxy) -> str:
    return make_url(pg_url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


def _replay(client, deadline_s: float = 30.0) -> None:
    """Flushes until the spool is empty (the writer retries a down database once a second)."""
    ledger = platform_of(client).ledger
    deadline = time.monotonic() + deadline_s
    while True:
        flush(client)
        if ledger.spool.empty and not ledger.down:
            return
        assert time.monotonic() < deadline, "the spool was not replayed"
        time.sleep(0.05)


def _metric(client, name: str) -> float:
    line = next(x for x in client.get("/metrics", headers=ADMIN).text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


@pytest.mark.parametrize("fail_open", [True, False])
def test_database_down_spools_usage_and_it_lands_exactly_once(postgres_backend, pg_url, proxy, tmp_path, fail_open):
    overrides = {"database_url": _through(pg_url, proxy), "data_dir": tmp_path, "ledger_fail_open": fail_open}
    with app_client(postgres_backend, **overrides) as client:
        tenant, tenant_id, key = new_tenant(client, "outage")
        set_budget(client, tenant, 100_000)
        before = complete(client, key)
        flush(client)
        proxy.down()
        during = [complete(client, key)]
        flush(client)  # the write fails: to the spool
        assert platform_of(client).ledger.down and _metric(client, "loraplex_ledger_spool_events") >= 1
        assert list((tmp_path / "spool").glob("*.jsonl"))
        during += [complete(client, key) for _ in range(3)]
        if fail_open:
            assert all(r.status_code == 200 for r in during), [r.text for r in during]
        else:
            assert during[0].status_code == 200
            assert {r.json()["error"]["code"] for r in during[1:]} == {"ledger_unavailable"}
        proxy.up()
        _replay(client)
        served = [r.headers["x-request-id"] for r in [before, *during] if r.status_code == 200]
        rows = ledger_rows(postgres_backend.settings, tenant_id)
        assert sorted(r.request_id for r in rows) == sorted(served)
        assert_counters_match_ledger(client, tenant, tenant_id)
        assert _metric(client, "loraplex_ledger_spool_events") == 0 and not list((tmp_path / "spool").glob("*"))
        assert _metric(client, "loraplex_ledger_events_dropped_total") == 0  # an outage loses nothing
        assert _metric(client, "loraplex_ledger_events_quarantined_total") == 0 == _metric(
            client, "loraplex_ledger_spool_down")
        if not fail_open:
            assert complete(client, key).status_code == 200


def _event(row, **changes) -> UsageEvent:
    fields = {f.name for f in dataclasses.fields(UsageEvent)}
    values = {k: v for k, v in row._mapping.items() if k in fields}
    values.update(tenant="t", key_prefix="lpx-x", ttft_s=None, latency_s=0.1)
    return UsageEvent(**{**values, **changes})


def test_a_stopped_processes_spool_is_replayed_once_by_the_next_process(postgres_backend, tmp_path):
    with app_client(postgres_backend, data_dir=tmp_path) as client:
        tenant, tenant_id, key = new_tenant(client, "crashed")
        set_budget(client, tenant, 100_000)
        for _ in range(3):
            assert complete(client, key).status_code == 200
        flush(client)
        rows = ledger_rows(postgres_backend.settings, tenant_id)
    # A process that wrote two of these rows, then died before deleting its spool, and one that never got in.
    left = Spool(tmp_path / "spool", "stopped")
    left.append([_event(rows[0]), _event(rows[1]), _event(rows[2], request_id="req_from_the_spool")])
    left.close()
    with app_client(postgres_backend, data_dir=tmp_path) as client:
        _replay(client)
        after = ledger_rows(postgres_backend.settings, tenant_id)
        assert sorted(r.request_id for r in after) == sorted([r.request_id for r in rows] + ["req_from_the_spool"])
        assert rollup_tokens(postgres_backend.settings, tenant_id) == tokens(after)
        assert not list((tmp_path / "spool").glob("*"))
        assert_counters_match_ledger(client, tenant, tenant_id)


def test_the_same_batch_written_twice_is_counted_once(backend):
    with app_client(backend) as client:
        tenant, tenant_id, key = new_tenant(client, "twice")
        assert complete(client, key).status_code == 200
        flush(client)
    (row,) = ledger_rows(backend.settings, tenant_id)
    events = [_event(row), _event(row, request_id=row.request_id + "_b")]

    async def write_twice(engine):
        return await write_events(engine, events), await write_events(engine, events + events)

    first, second = with_db(backend.settings, write_twice)
    assert first == second and first[row.request_id] == row.id
    rows = ledger_rows(backend.settings, tenant_id)
    assert len(rows) == 2 and rollup_tokens(backend.settings, tenant_id) == tokens(rows)
