"""The learned scorer served, and calibration through the admin API, on a fresh Postgres database:
each `auto` request's score lands in its ledger row (route_score), `POST /admin/api/auto/calibrate`
sets the pool's limits for a share over the recorded scores, and `GET /admin/api/auto/shares` reports
what each model got per day; the admin UI shows those shares and calibrates with its form."""

from __future__ import annotations

import re
import secrets
from datetime import timedelta

import numpy as np
import pytest
from litestar.testing import TestClient
from sqlalchemy import insert

from loraplex.admin_ui import AdminUI
from loraplex.billing.tables import usage_ledger
from loraplex.billing.usage import utcnow
from loraplex.platform.db.provision import create_database, drop_database
from loraplex.platform.settings import Settings
from tests.integration.billing_support import ADMIN, flush, ledger_rows, new_tenant, with_db
from tests.integration.conftest import ADMIN_TOKEN, PG_SERVER, Backend, _migrate, run
from tests.integration.test_admin_ui import csrf_of, login
from tests.integration.test_auto_routing import two_model_engine

PROMPTS = ["Hello", "What is 2 + 2?", "Prove that there are infinitely many primes, step by step.",
           "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?",
           "Which of these is a mammal?\nA. shark\nB. whale\nC. trout\nD. squid\nAnswer:"]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    url = run(create_database(PG_SERVER, prefix="loraplex_test_calibrate_"))
    tag = secrets.token_hex(3)
    small, large = f"cal-small-{tag}", f"cal-large-{tag}"
    engine = two_model_engine(small, large)
    try:
        run(_migrate(url))
        settings = Settings(data_dir=tmp_path_factory.mktemp("caldata"), database_url=url, admin_token=ADMIN_TOKEN)
        with TestClient(Backend("postgres", settings, engine).app(plugins=[AdminUI()]), timeout=60) as client:
            yield client, settings, small, large
    finally:
        engine.inner.shutdown()
        run(drop_database(url))


def chat(client, key: str, content: str):
    return client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
        "model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0})


def test_learned_scores_are_recorded_and_calibration_sets_the_share(app):
    client, settings, small, large = app
    for model, limit in ((small, 0.5), (large, 1.0)):
        assert client.patch(f"/admin/api/models/{model}", json={"auto_max_complexity": limit},
                            headers=ADMIN).status_code == 200
    _, tenant_id, key = new_tenant(client, "cal")
    headers = []
    for prompt in PROMPTS:
        r = chat(client, key, prompt)
        assert r.status_code == 200, r.text
        headers.append(float(r.headers["x-loraplex-complexity"]))
    assert len(set(headers)) == len(PROMPTS)  # the learned scorer, not the heuristic's zeros
    flush(client)
    rows = ledger_rows(settings, tenant_id)
    assert sorted(r.route_score for r in rows) == sorted(headers)

    # a synthetic week of scores: 2000 requests, beta(2, 5)
    scores = np.random.default_rng(5).beta(2, 5, 2000)
    now = utcnow()

    async def seed(engine):
        async with engine.begin() as conn:
            await conn.execute(insert(usage_ledger), [{
                "request_id": f"seed-{i}", "created_at": now - timedelta(hours=i % 72), "tenant_id": tenant_id,
                "key_id": 0, "model": small if s <= 0.5 else large, "priority": "standard", "routed_from": "auto",
                "route_score": float(s), "endpoint": "chat.completions", "prompt_tokens": 1, "cached_tokens": 0,
                "completion_tokens": 1, "latency_ms": 1, "status": "ok"} for i, s in enumerate(scores)])

    with_db(settings, seed)
    dry = client.post("/admin/api/auto/calibrate", headers=ADMIN, json={"strong_share": 0.2, "since": "7d",
                                                                        "dry_run": True})
    assert dry.status_code == 200 and dry.json()["applied"] is False, dry.text
    models = {m["name"]: m["auto_max_complexity"] for m in client.get("/admin/api/models", headers=ADMIN).json()}
    assert models[small] == 0.5  # a dry run sets nothing
    r = client.post("/admin/api/auto/calibrate", headers=ADMIN, json={"strong_share": 0.2, "since": "7d"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["scores"] == 2000 + len(PROMPTS) and body["thresholds"][large] == 1.0
    got = float(np.mean(np.concatenate([scores, headers]) > body["thresholds"][small]))
    assert abs(got - 0.2) <= 0.05 and abs(body["expected"][large] - 0.2) <= 0.05
    models = {m["name"]: m["auto_max_complexity"] for m in client.get("/admin/api/models", headers=ADMIN).json()}
    assert models[small] == body["thresholds"][small] and models[large] == 1.0

    shares = client.get("/admin/api/auto/shares", params={"since": "7d"}, headers=ADMIN)
    assert shares.status_code == 200, shares.text
    days = {}
    for row in shares.json():
        days.setdefault(row["day"], []).append(row)
    assert 3 <= len(days) <= 4 and sum(r["requests"] for r in shares.json()) == 2000 + len(PROMPTS)
    for rows_of_day in days.values():
        assert sum(r["share"] for r in rows_of_day) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("body,error", [
    ({"strong_share": 2}, "strong_share"), ({"strong_share": 0.2, "since": "forever"}, "since must be"),
    ({"shares": {"nope": 1.0}}, "each model"), ({"strong_share": "x"}, "strong_share"), ({}, "strong_share"),
])
def test_bad_calibrations_are_400s(app, body, error):
    client = app[0]
    r = client.post("/admin/api/auto/calibrate", headers=ADMIN, json=body)
    assert r.status_code == 400 and error in r.text, r.text
    assert client.get("/admin/api/auto/shares", params={"since": "x" * 100}, headers=ADMIN).status_code == 400
    assert client.post("/admin/api/auto/calibrate", json={"strong_share": 0.2}).status_code == 401


def test_the_admin_ui_shows_daily_shares_and_calibrates(app):
    """After the test above: its seeded days are on the overview, and the form sets a 50% share."""
    client, _, small, large = app
    assert login(client).status_code == 303
    page = client.get("/admin")
    assert page.status_code == 200 and 'id="auto-share-table"' in page.text
    shown = re.findall(r'<tr data-day="([0-9-]+)" data-model="([^"]+)" data-share="([0-9.]+)"', page.text)
    assert {m for _, m, _ in shown} == {small, large} and len({d for d, _, _ in shown}) >= 3
    r = client.post("/admin/models/calibrate", data={"csrf": csrf_of(client, "/admin"), "strong_share": "0.5",
                                                     "since": "7d"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin#auto-shares", r.text
    limits = {m["name"]: m["auto_max_complexity"] for m in client.get("/admin/api/models", headers=ADMIN).json()}
    dry = client.post("/admin/api/auto/calibrate", headers=ADMIN, json={"strong_share": 0.5, "dry_run": True}).json()
    assert limits[small] == dry["thresholds"][small] and abs(dry["expected"][large] - 0.5) <= 0.05
    bad = client.post("/admin/models/calibrate", data={"csrf": csrf_of(client, "/admin"), "strong_share": "lots"})
    assert bad.status_code == 400 and "strong_share must be a number" in bad.text
