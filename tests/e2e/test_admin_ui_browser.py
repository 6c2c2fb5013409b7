"""The admin UI in headless Chromium (Debian's, through Playwright) against the real `loraplex serve`:
an admin logs in, creates a tenant and a key, sees the key's traffic in the usage chart, deletes an
adapter (after dismissing the confirmation once), revokes the key, disables the tenant and logs out;
each change is checked through the tenant API with the `openai` client; the overview puts the model
in `auto`'s pool and takes it out. No page logs an error, so
the pages' own script and styles pass the Content-Security-Policy."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from tests.e2e.server import start
from tests.e2e.test_cli_platform import EMBEDDED

ADMIN = "e2e-admin-ui-token"
MODEL = "synthetic:tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {**EMBEDDED, "LORAPLEX_DATA_DIR": str(tmp_path_factory.mktemp("data")), "LORAPLEX_ADMIN_TOKEN": ADMIN}
    srv = start(env, "--no-demo")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(base_url=server.base_url, permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.errors = []  # console errors (a CSP violation is one) and uncaught exceptions
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    yield page
    context.close()


def ask(key: str, server, model: str = MODEL) -> str:
    client = openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return answer.choices[0].message.content


def submit_confirmed(page: Page, button, accept: bool) -> None:
    page.once("dialog", lambda d: d.accept() if accept else d.dismiss())
    button.click()


def test_an_admin_runs_a_tenant_through_the_ui(page: Page, server, tmp_path):
    page.goto("/admin/tenants")
    expect(page).to_have_url(f"{server.base_url}/admin/login?next=/admin/tenants")
    page.fill("input[name=token]", "not-the-token")
    page.click("button[type=submit]")
    expect(page.get_by_role("alert")).to_have_text("That is not the admin token.")
    page.fill("input[name=token]", ADMIN)
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{server.base_url}/admin/tenants")
    assert page.eval_on_selector("header.top", "e => getComputedStyle(e).backgroundColor") == "rgb(29, 35, 48)"

    page.fill("#new-tenant input[name=name]", "acme")
    page.click("#new-tenant button[type=submit]")
    expect(page).to_have_url(f"{server.base_url}/admin/tenants/acme")
    expect(page.locator("#tenant-status")).to_have_text("active")

    page.fill("#new-key-form input[name=key_name]", "web")
    page.fill("#new-key-form input[name=rpm_limit]", "50")
    page.click("#new-key-form button[type=submit]")
    key = page.inner_text("#new-key")
    page.click("button[data-copy]")
    expect(page.locator("button[data-copy]")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == key and key.startswith("lpx-")

    from tests.e2e.test_serve_models import peft_dir

    r = httpx.post(f"{server.base_url}/admin/api/tenants/acme/adapters", headers={"authorization": f"Bearer {ADMIN}"},
                   json={"name": "tuned", "base_model": MODEL, "path": peft_dir(tmp_path, 3)}, timeout=60)
    assert r.status_code == 201, r.text
    ask(key, server), ask(key, server, "tuned")

    page.goto("/admin/tenants/acme")
    for _ in range(100):  # the ledger writes usage in batches
        if "2 requests in the last 30 days" in page.inner_text("#usage"):
            break
        page.wait_for_timeout(200)
        page.reload()
    expect(page.locator("#usage")).to_contain_text("2 requests in the last 30 days")
    today = page.locator("svg.chart g.bar").last
    assert int(today.get_attribute("data-input")) > 0 and int(today.get_attribute("data-output")) > 0
    expect(page.locator(f'#keys tr[data-prefix="{key[:12]}"]')).to_contain_text("50 RPM")

    page.select_option("#budget-form select[name=period]", "day")
    page.fill("#budget-form input[name=limit_tokens]", "1000000")
    page.click("#budget-form button[type=submit]")
    expect(page.locator('tr[data-budget="tenant-day"]')).to_contain_text("1,000,000")
    with page.expect_download() as download:
        page.click("#export-form button[type=submit]")
    assert download.value.suggested_filename.startswith("loraplex-invoice-")
    assert download.value.suggested_filename.endswith("-acme.csv")
    assert "acme" in Path(download.value.path()).read_text()

    delete = page.locator('#adapters tr[data-adapter="tuned"] button')
    submit_confirmed(page, delete, accept=False)  # dismissed: nothing is sent
    expect(page.locator('#adapters tr[data-adapter="tuned"]')).to_have_count(1)
    submit_confirmed(page, delete, accept=True)
    expect(page.locator('#adapters tr[data-adapter="tuned"]')).to_have_count(0)
    with pytest.raises(openai.NotFoundError):
        ask(key, server, "tuned")

    submit_confirmed(page, page.locator(f'#keys tr[data-prefix="{key[:12]}"] button'), accept=True)
    expect(page.locator(f'#keys tr[data-prefix="{key[:12]}"] .badge')).to_have_text("revoked")
    with pytest.raises(openai.AuthenticationError):
        ask(key, server)

    submit_confirmed(page, page.get_by_role("button", name="Disable tenant"), accept=True)
    expect(page.locator("#tenant-status")).to_have_text("disabled")
    page.click("header .logout button")
    expect(page).to_have_url(f"{server.base_url}/admin/login")
    page.goto("/admin")
    expect(page).to_have_url(f"{server.base_url}/admin/login?next=/admin")
    # the one error: Chromium logs the wrong token's 401 page as a failed load
    assert page.errors == ["Failed to load resource: the server responded with a status of 401 (Unauthorized)"]


def test_the_overview_shows_the_engine_and_models(page: Page, server):
    page.goto("/admin/login")
    page.fill("input[name=token]", ADMIN)
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{server.base_url}/admin")
    expect(page.locator("#models")).to_contain_text(MODEL)
    expect(page.locator("#models")).to_contain_text("yes")
    expect(page.locator("#stat-running")).to_have_text("0")
    assert page.locator("svg.chart g.bar").count() == 30 and page.errors == []

    # `auto`'s pool: any value from 0 to 1 (not only steps of the spinner), blank takes it out
    limit = page.locator(f'#models tr[data-model="{MODEL}"] input[name=auto_max_complexity]')
    limit.fill("0.33")
    page.locator(f'#models tr[data-model="{MODEL}"] button').click()
    expect(page).to_have_url(f"{server.base_url}/admin#models")
    expect(limit).to_have_value("0.33")
    admin = {"authorization": f"Bearer {ADMIN}"}
    httpx.post(f"{server.base_url}/admin/api/tenants", headers=admin, json={"name": "router"}, timeout=30)
    key = httpx.post(f"{server.base_url}/admin/api/tenants/router/keys", headers=admin, json={}, timeout=30).json()
    client = openai.OpenAI(api_key=key["key"], base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.model == MODEL
    limit.fill("")
    page.locator(f'#models tr[data-model="{MODEL}"] button').click()
    expect(limit).to_have_value("")
    with pytest.raises(openai.NotFoundError):  # the pool is empty again (this server's writes apply at once)
        client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert page.errors == []
