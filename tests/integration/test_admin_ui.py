"""The admin UI over HTTP on a real app (Postgres + Redis, and embedded SQLite): the login, its
cookie and CSRF checks, the headers its pages send, what its pages show of the platform's state,
and its forms reaching the tenant API (revoked keys, deleted adapters, disabled tenants).
tests/e2e/test_admin_ui_browser.py drives the same pages in Chromium."""

from __future__ import annotations

import re
import secrets
import time

import pytest
from litestar.testing import TestClient

from loraplex.admin_ui import AdminUI
from loraplex.admin_ui.session import COOKIE
from tests.integration.conftest import ADMIN_TOKEN

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def ui(backend):
    with TestClient(backend.app(plugins=[AdminUI()]), timeout=60) as client:
        yield client


def login(client: TestClient, token: str = ADMIN_TOKEN, next_page: str = "/admin"):
    client.cookies.clear()
    return client.post("/admin/login", data={"token": token, "next": next_page}, follow_redirects=False)


def csrf_of(client: TestClient, path: str = "/admin/tenants") -> str:
    r = client.get(path)
    assert r.status_code == 200, r.text
    return re.search(r'name="csrf" value="([0-9a-f]+)"', r.text).group(1)


def make_tenant(client: TestClient) -> tuple[str, str]:
    name = f"ui-{secrets.token_hex(3)}"
    assert client.post("/admin/api/tenants", json={"name": name}, headers=ADMIN).status_code == 201
    key = client.post(f"/admin/api/tenants/{name}/keys", json={"rpm_limit": 100}, headers=ADMIN).json()["key"]
    return name, key


def ask(client: TestClient, key: str, model: str = "synthetic:tiny"):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


def chat(client: TestClient, key: str, model: str = "synthetic:tiny") -> int:
    return ask(client, key, model).status_code


def test_pages_need_a_login_with_the_admin_token(ui):
    ui.cookies.clear()
    r = ui.get("/admin/tenants", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin/login?next=/admin/tenants"
    r = login(ui, token="not-it")
    assert r.status_code == 401 and "not the admin token" in r.text and COOKIE not in ui.cookies
    r = login(ui, next_page="/admin/tenants")
    assert r.status_code == 303 and r.headers["location"] == "/admin/tenants"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin" in cookie
    assert ui.get("/admin/tenants").status_code == 200
    assert login(ui, next_page="//elsewhere.example/admin").headers["location"] == "/admin"  # no open redirect

    issued, nonce, mac = ui.cookies[COOKIE].split(".")
    ui.cookies.set(COOKIE, f"{int(issued) - 1}.{nonce}.{mac}", path="/admin")  # tampered
    assert ui.get("/admin", follow_redirects=False).status_code == 303


def test_the_ui_is_off_without_an_admin_token(backend):
    with TestClient(backend.app(plugins=[AdminUI()], admin_token=None), timeout=60) as client:
        for r in (client.get("/admin/login"), login(client, token="")):
            assert r.status_code == 403 and "LORAPLEX_ADMIN_TOKEN" in r.text


def test_pages_are_not_cached_framed_or_open_to_other_scripts(ui):
    login(ui)
    for r in (ui.get("/admin"), ui.get("/admin/tenants/no-such-tenant"), ui.get("/admin/login")):
        assert r.headers["cache-control"] == "no-store" and r.headers["x-frame-options"] == "DENY"
        assert "default-src 'self'" in r.headers["content-security-policy"]
    assert ui.get("/admin/tenants/no-such-tenant").status_code == 404


def test_a_form_without_this_sessions_csrf_token_changes_nothing(ui):
    login(ui)
    stale = csrf_of(ui)
    login(ui)  # a new session, whose forms carry another token
    assert csrf_of(ui) != stale
    for token in ("", "0" * 64, stale):
        r = ui.post("/admin/tenants", data={"csrf": token, "name": "forged"})
        assert r.status_code == 403 and "reload the page" in r.text
    assert ui.get("/admin/api/tenants/forged", headers=ADMIN).status_code == 404
    assert ui.post("/admin/logout", data={"csrf": stale}).status_code == 403


def test_a_tenant_page_shows_its_keys_adapters_budgets_and_usage(ui, peft_dirs):
    login(ui)
    name, key = make_tenant(ui)
    prefix = key[:12]
    assert ui.post(f"/admin/api/tenants/{name}/adapters", headers=ADMIN, json={
        "name": "tuned", "base_model": "synthetic:tiny", "path": str(peft_dirs[0])}).status_code == 201
    assert ui.post("/admin/api/budgets", headers=ADMIN,
                   json={"tenant": name, "period": "month", "limit_tokens": 123456}).status_code == 200
    answers = [ask(ui, key), ask(ui, key, "tuned")]
    assert [r.status_code for r in answers] == [200, 200]

    deadline = time.monotonic() + 30
    while "2 requests in the last 30 days" not in ui.get(f"/admin/tenants/{name}").text:
        assert time.monotonic() < deadline, "usage never reached the page"  # the ledger writes in batches
        time.sleep(0.1)
    page = ui.get(f"/admin/tenants/{name}").text  # every read of this render after the batch's commit
    keys_row = re.search(rf'<tr data-prefix="{prefix}">(.*?)</tr>', page, re.S).group(1)
    assert 'class="badge active"' in keys_row and "100 RPM" in keys_row
    assert 'data-adapter="tuned"' in page
    budget = re.search(r'<tr data-budget="tenant-month">(.*?)</tr>', page, re.S).group(1)
    used = int(re.search(r'<td class="num used">([\d,]+)</td>', budget).group(1).replace(",", ""))
    assert "123,456" in budget and used == sum(r.json()["usage"]["total_tokens"] for r in answers)
    today = re.findall(r'<g class="bar" data-label="([^"]+)" data-input="(\d+)" data-output="(\d+)"', page)[-1]
    assert int(today[1]) > 0 and int(today[2]) > 0  # the last bar is today (UTC)
    assert re.search(r"<td>synthetic:tiny</td><td>tuned</td>", page) and "<td>(base)</td>" in page
    assert re.search(rf'<a href="/admin/tenants/{name}">{name}</a>', ui.get("/admin").text)  # this month's totals


def test_forms_revoke_keys_delete_adapters_and_disable_tenants(ui, peft_dirs):
    login(ui)
    name, key = make_tenant(ui)
    _, other = make_tenant(ui)
    assert ui.post(f"/admin/api/tenants/{name}/adapters", headers=ADMIN, json={
        "name": "gone", "base_model": "synthetic:tiny", "path": str(peft_dirs[1])}).status_code == 201
    second = ui.post(f"/admin/api/tenants/{name}/keys", json={}, headers=ADMIN).json()["key"]
    csrf = csrf_of(ui, f"/admin/tenants/{name}")
    assert chat(ui, second, "gone") == 200

    r = ui.post(f"/admin/tenants/{name}/adapters/gone/delete", data={"csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/admin/tenants/{name}"
    assert chat(ui, second, "gone") == 404 and 'data-adapter="gone"' not in ui.get(r.headers["location"]).text

    assert ui.post(f"/admin/keys/{key[:12]}/revoke", data={"csrf": csrf}).status_code == 200
    assert chat(ui, key) == 401 and chat(ui, second) == 200

    assert ui.post(f"/admin/tenants/{name}/status", data={"csrf": csrf, "status": "disabled"}).status_code == 200
    assert chat(ui, second) in (401, 403) and chat(ui, other) == 200
    page = ui.post(f"/admin/tenants/{name}/status", data={"csrf": csrf, "status": "active"}).text
    assert 'id="tenant-status">active' in page and chat(ui, second) == 200

    r = ui.post(f"/admin/tenants/{name}/keys", data={"csrf": csrf, "key_name": "made-in-ui", "rpm_limit": "7"})
    new_key = re.search(r'id="new-key">(lpx-[^<]+)<', r.text).group(1)
    assert r.status_code == 201 and chat(ui, new_key) == 200
    for field, bad in (("rpm_limit", "-1"), ("tpm_limit", "lots"), ("expires_in_days", "nan")):
        r = ui.post(f"/admin/tenants/{name}/keys", data={"csrf": csrf, field: bad})
        assert r.status_code == 400 and f"{field.replace('_', ' ')} must be a positive number" in r.text

    assert ui.post("/admin/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 303
    assert ui.get("/admin", follow_redirects=False).status_code == 303


def test_budgets_scoped_keys_and_exports_through_the_ui(ui):
    login(ui)
    name, key = make_tenant(ui)
    csrf = csrf_of(ui, f"/admin/tenants/{name}")
    r = ui.post(f"/admin/tenants/{name}/keys", data={"csrf": csrf, "allowed_models": " synthetic:tiny, ",
                                                      "allowed_adapters": "only-this"})
    scoped = re.search(r'id="new-key">(lpx-[^<]+)<', r.text).group(1)
    row = re.search(rf'<tr data-prefix="{scoped[:12]}">(.*?)</tr>', ui.get(f"/admin/tenants/{name}").text, re.S)
    assert "models: synthetic:tiny; adapters: only-this" in row.group(1)

    r = ui.post(f"/admin/tenants/{name}/budgets", data={"csrf": csrf, "period": "day", "limit_tokens": "3"},
                follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/admin/tenants/{name}#budgets"
    listed = ui.get(f"/admin/api/budgets?tenant={name}", headers=ADMIN).json()
    assert [(b["period"], b["key"], b["limit_tokens"]) for b in listed] == [("day", None, 3)]
    refused = ask(ui, key)  # max_tokens alone (4) is over the day's 3 tokens
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
    ui.post(f"/admin/tenants/{name}/budgets", data={"csrf": csrf, "period": "month", "limit_tokens": "900",
                                                     "soft_limit_tokens": "800", "key": key[:12]})
    page = ui.get(f"/admin/tenants/{name}").text
    assert f'data-budget="{key[:12]}-month"' in page and 'data-budget="tenant-day"' in page
    for bad, message in (({"period": "day", "limit_tokens": ""}, "limit tokens must be a positive number"),
                         ({"period": "fortnight", "limit_tokens": "9"}, "period must be one of day, week, month, "
                                                                         "total, got &#39;fortnight&#39;"),
                         ({"period": "day", "limit_tokens": "9", "soft_limit_tokens": "12"}, "soft_limit_tokens")):
        r = ui.post(f"/admin/tenants/{name}/budgets", data={"csrf": csrf, "key": key[:12], **bad})
        assert r.status_code == 400 and message in r.text  # the tenant page again, the form as it was typed
        form = re.search(r'<form[^>]+id="budget-form".*?</form>', r.text, re.S).group(0)
        assert 'role="alert"' in form and f'value="{key[:12]}" selected' in form
        assert f'name="limit_tokens" inputmode="numeric" size="10" required value="{bad["limit_tokens"]}"' in form
    ui.post(f"/admin/tenants/{name}/budgets/delete", data={"csrf": csrf, "period": "day"})
    assert chat(ui, key) == 200
    assert [b["period"] for b in ui.get(f"/admin/api/budgets?tenant={name}", headers=ADMIN).json()] == ["month"]

    month = time.strftime("%Y-%m", time.gmtime())
    deadline = time.monotonic() + 30
    while name not in (r := ui.get(f"/admin/billing/export?period={month}&format=csv&tenant={name}")).text:
        assert time.monotonic() < deadline, "the request never reached the export"
        time.sleep(0.1)
    assert r.headers["content-disposition"].startswith("attachment;") and r.text.startswith("record,")
    r = ui.get("/admin/billing/export?period=someday")
    assert r.status_code == 400 and "period must be YYYY-MM" in r.text


def test_a_page_while_the_database_is_down_says_so(postgres_backend, pg_url):
    from sqlalchemy import make_url

    from tests.integration.tcp_proxy import TcpProxy

    url = make_url(pg_url)
    proxy = TcpProxy(url.host or "localhost", url.port or 5432).start()
    through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    try:
        with TestClient(postgres_backend.app(plugins=[AdminUI()], database_url=through), timeout=60) as client:
            login(client)
            assert client.get("/admin/tenants").status_code == 200
            proxy.down()
            r = client.get("/admin/tenants")
            assert r.status_code == 503 and "database is unavailable" in r.text and "<!doctype html>" in r.text
            proxy.up()
            assert client.get("/admin/tenants").status_code == 200
    finally:
        proxy.stop()


def test_prices_added_in_the_ui_charge_later_requests(ui):
    login(ui)
    name, key = make_tenant(ui)
    csrf = csrf_of(ui, "/admin")
    price = {"csrf": csrf, "model": "synthetic:tiny", "input_per_1m": "1234.5", "cached_input_per_1m": "500",
             "output_per_1m": "2000", "currency": "eur"}
    r = ui.post("/admin/prices", data=price, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin#prices"
    (added,) = [p for p in ui.get("/admin/api/prices?model=synthetic:tiny", headers=ADMIN).json()
                if p["input_per_1m"] == "1234.50"]
    assert (added["currency"], added["cached_input_per_1m"], added["output_per_1m"]) == ("EUR", "500.00", "2000.00")
    assert f'<tr data-price="{added["id"]}"><td>synthetic:tiny</td><td>EUR</td>' in ui.get("/admin").text
    for bad, message in (({"input_per_1m": "lots"}, "input_per_1m"),
                         ({"model": "nope"}, "&#39;nope&#39; is not registered"),
                         ({"effective_from": "yesterday"}, "effective from must be a date and time"),
                         ({"effective_from": "2020-01-01T00:00"}, "must not be in the past")):
        r = ui.post("/admin/prices", data={**price, **bad})
        assert r.status_code in (400, 404) and message in r.text, r.text

    assert chat(ui, key) == 200
    deadline = time.monotonic() + 30
    while not re.search(r"<td>EUR</td>.*?<td class=\"num\">0\.0*[1-9]", page := ui.get(f"/admin/tenants/{name}").text,
                        re.S):
        assert time.monotonic() < deadline, "the priced request never reached the tenant's page"
        time.sleep(0.1)
    assert re.search(r"<td>synthetic:tiny</td><td>\(base\)</td>\s*<td>EUR</td>", page)


def test_the_models_form_puts_a_model_in_autos_pool_and_takes_it_out(ui):
    login(ui)
    _, key = make_tenant(ui)
    csrf = csrf_of(ui, "/admin")
    form = {"csrf": csrf, "model": "synthetic:tiny", "auto_max_complexity": "0.45"}
    try:
        r = ui.post("/admin/models/route", data=form, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/admin#models"
        row = re.search(r'<tr data-model="synthetic:tiny">.*?</tr>', ui.get("/admin").text, re.S).group(0)
        assert 'value="0.45"' in row
        routed = ask(ui, key, "auto")
        assert routed.status_code == 200 and routed.json()["model"] == "synthetic:tiny"
        for bad, message in (("1.5", "from 0 to 1"), ("high", "must be a number")):
            r = ui.post("/admin/models/route", data={**form, "auto_max_complexity": bad})
            assert r.status_code == 400 and message in r.text, r.text
        r = ui.post("/admin/models/route", data={**form, "model": "nope"})
        assert r.status_code == 404 and "not registered" in r.text
        ui.post("/admin/models/route", data={**form, "auto_max_complexity": ""}, follow_redirects=False)
        assert chat(ui, key, "auto") == 404
    finally:  # other tests share this catalog
        ui.patch("/admin/api/models/synthetic:tiny", json={"auto_max_complexity": None}, headers=ADMIN)


def test_the_overview_and_engine_stats_report_the_prefix_cache_and_speculation(ui):
    """A greedy request alone whose output repeats itself speculates; its drafts show up for operators."""
    _, key = make_tenant(ui)
    before = ui.get("/admin/api/engine/stats", headers=ADMIN).json()
    phrase = [40, 41, 42, 43, 44]
    body = {"model": "synthetic:tiny", "prompt": phrase * 10, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    assert ui.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}).status_code == 200
    after = ui.get("/admin/api/engine/stats", headers=ADMIN).json()
    drafted = after["speculation"]["draft_tokens"] - before["speculation"]["draft_tokens"]
    kept = after["speculation"]["accepted_tokens"] - before["speculation"]["accepted_tokens"]
    assert drafted > 0 and 0 <= kept <= drafted
    assert after["kv"]["prefix_query_tokens"] - before["kv"]["prefix_query_tokens"] == 50
    # memory sizing: a configured KV cache on the CPU (its blocks' bytes), nothing measured there
    memory = after["memory"]
    assert memory["kv_cache_bytes"] > 0 and memory["budget_bytes"] == 0 and memory["peak_step_bytes"] == 0
    # which compute path runs the engine in this process, and why
    compute = after["compute"]
    assert compute["device"] == "cpu" and compute["ops"] in ("c", "torch") and compute["reason"]
    assert compute["threads"] >= 1 and compute["kv_cache_dtype"]
    login(ui)
    page = ui.get("/admin").text
    assert re.search(r'id="stat-spec">\d+%</span><span class="label">of [\d,]+ speculative drafts kept', page)
    assert re.search(r'id="stat-prefix">\d+%</span>', page)
    # an engine in this process: no replicas to list
    assert ui.get("/admin/api/engine/replicas", headers=ADMIN).json() == [] and 'id="replicas"' not in page


def test_live_json_needs_a_login_and_holds_a_bounded_history(ui):
    ui.cookies.clear()
    assert ui.get("/admin/live.json", follow_redirects=False).status_code == 303
    login(ui)
    body = ui.get("/admin/live.json").json()
    assert body["interval_s"] == 5.0 and len(body["t"]) <= 180
    assert {c["id"] for c in body["charts"]} == {"requests", "tokens", "ttft", "itl", "queue", "kv", "problems",
                                                 "latency"}
    assert all(len(s["values"]) == len(body["t"]) for c in body["charts"] for s in c["series"])
