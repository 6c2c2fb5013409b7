"""Token budgets: 429 insufficient_quota, never overshooting, key budgets, soft-limit alerts, the
tenant's default max_tokens, budgets shared by two instances under 200 concurrent requests, and
bad input that changes nothing."""

from __future__ import annotations

from tests.integration.billing_support import (
    ADMIN,
    PROMPT,
    SLOW_OK,
    app_client,
    assert_counters_match_ledger,
    budgets,
    complete,
    flood_two_instances,
    new_tenant,
    set_budget,
    tokens,
)


def test_budget_refuses_with_insufficient_quota_and_never_overshoots(backend):
    with app_client(backend) as client:
        tenant, tenant_id, key = new_tenant(client)
        set_budget(client, tenant, 200)
        answers = [complete(client, key, max_tokens=20) for _ in range(9)]
        ok = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code != 200]
        assert len(ok) >= 200 // (PROMPT + 20) and refused, [r.status_code for r in answers]
        err = refused[-1].json()["error"]
        assert refused[-1].status_code == 429
        assert err["type"] == err["code"] == "insufficient_quota" and "tenant month budget" in err["message"]
        rows = assert_counters_match_ledger(client, tenant, tenant_id)
        assert tokens(rows) <= 200
        assert sorted(r.request_id for r in rows) == sorted(r.headers["x-request-id"] for r in ok)
        assert 'loraplex_budget_rejections_total{scope="tenant"}' in client.get("/metrics", headers=ADMIN).text


def test_key_budget_soft_limit_and_the_tenants_default_max_tokens(postgres_backend):
    with app_client(postgres_backend) as client:
        tenant, tenant_id, key = new_tenant(client, default_max_tokens=5)
        other = client.post(f"/admin/api/tenants/{tenant}/keys", json={}, headers=ADMIN).json()["key"]
        set_budget(client, tenant, 60, "day", key=key[:12], soft_limit_tokens=20)
        set_budget(client, tenant, 10_000, "total")
        chat = {"model": "synthetic:tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        first = client.post("/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {key}"})
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] <= 5  # capped by the tenant's default
        while complete(client, key, max_tokens=5).status_code == 200:
            pass
        refused = complete(client, key, max_tokens=5)
        assert refused.status_code == 429 and "key " + key[:12] + " day budget" in refused.json()["error"]["message"]
        assert complete(client, other, max_tokens=5).status_code == 200  # the other key has no budget
        metrics = client.get("/metrics", headers=ADMIN).text
        label = f'budget="key day",tenant="{tenant}"'  # no key prefix in a label
        assert f"loraplex_budget_soft_limit_reached{{{label}}} 1.0" in metrics
        assert f"loraplex_budget_soft_limit_alerts_total{{{label}}} 1.0" in metrics
        rows = assert_counters_match_ledger(client, tenant, tenant_id)
        assert tokens(r for r in rows if r.key_id != rows[-1].key_id) <= 60
        listed = {b["period"]: b for b in budgets(client, tenant)}
        assert listed["total"]["used_tokens"] == tokens(rows) and listed["day"]["key"] == key[:12]


def test_two_instances_200_concurrent_requests_stay_within_the_budget(postgres_backend):
    with app_client(postgres_backend, **SLOW_OK) as a, app_client(postgres_backend, **SLOW_OK) as b:
        flood_two_instances(a, b)


def test_budget_and_price_input_is_checked_and_bad_input_writes_nothing(api):
    client = api.client
    tenant, _, key = new_tenant(client)
    bad = [({"period": "fortnight", "limit_tokens": 10}, "period"),
           ({"period": "w" * 100_000, "limit_tokens": 10}, "period"),
           ({"period": "day", "limit_tokens": 0}, "limit_tokens"),
           ({"period": "day", "limit_tokens": 10, "soft_limit_tokens": 11}, "soft_limit_tokens"),
           ({"period": "day", "limit_tokens": "ten"}, "limit_tokens")]
    for body, param in bad:
        r = client.post("/admin/api/budgets", json={"tenant": tenant, **body}, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    missing = client.post("/admin/api/budgets", json={"tenant": tenant, "period": "day", "limit_tokens": 5,
                                                      "key": "lpx-nothere0"}, headers=ADMIN)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "key"
    assert client.post("/admin/api/budgets", json={"tenant": "nobody", "period": "day", "limit_tokens": 5},
                       headers=ADMIN).status_code == 404
    assert budgets(client, tenant) == []
    price = {"model": "synthetic:tiny", "input_per_1m": "1", "cached_input_per_1m": "0.5", "output_per_1m": "2"}
    prices_before = client.get("/admin/api/prices", headers=ADMIN).json()
    for change, param in (({"input_per_1m": "-1"}, "input_per_1m"), ({"output_per_1m": "0.0000001"}, "output_per_1m"),
                          ({"cached_input_per_1m": "abc"}, "cached_input_per_1m"), ({"currency": "usd"}, "currency"),
                          ({"effective_from": "2001-01-01T00:00:00Z"}, "effective_from")):
        r = client.post("/admin/api/prices", json={**price, **change}, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    unknown = client.post("/admin/api/prices", json={**price, "model": "no-such-model"}, headers=ADMIN)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert client.get("/admin/api/prices", headers=ADMIN).json() == prices_before
    r = client.patch(f"/admin/api/tenants/{tenant}", json={"default_max_tokens": 0}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "default_max_tokens"
    assert complete(client, key).status_code == 200  # no budget: nothing refuses
