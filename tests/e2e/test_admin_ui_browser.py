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
from playwright.sync_api import Page, expect

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


ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "admin-ui"  # gitignored


def shot(page: Page, name: str) -> None:
    """A full-page screenshot kept as a test artifact (test-artifacts/admin-ui/NAME.png)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def log_in(page: Page, server, where: str = "/admin") -> None:
    page.goto(f"/admin/login?next={where}")
    page.fill("input[name=token]", ADMIN)
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{server.base_url}{where}")


def admin_api(server, method: str, route: str, **body) -> dict:
    r = httpx.request(method, f"{server.base_url}/admin/api{route}", json=body, timeout=60,
                      headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code < 300, r.text
    return r.json()


def test_forms_keep_what_was_typed_confirm_changes_and_name_keys(page: Page, server):
    admin_api(server, "POST", "/tenants", name="shop")
    key = admin_api(server, "POST", "/tenants/shop/keys", name="web")["key"]
    prefix = key[:12]
    log_in(page, server, "/admin/tenants/shop")
    option = page.locator(f'#budget-form select[name=key] option[value="{prefix}"]')
    expect(option).to_have_text(f"key web ({prefix})")

    form = page.locator("#budget-form")
    form.locator("select[name=key]").select_option(prefix)
    form.locator("select[name=period]").select_option("week")
    form.locator("input[name=limit_tokens]").fill("100")
    form.locator("input[name=soft_limit_tokens]").fill("500")  # over the limit: refused
    form.locator("button[type=submit]").click()
    expect(page.locator("#budget-form [role=alert]")).to_contain_text("soft_limit_tokens")
    expect(page.locator("#budget-form input[name=limit_tokens]")).to_have_value("100")
    expect(page.locator("#budget-form input[name=soft_limit_tokens]")).to_have_value("500")
    expect(page.locator("#budget-form select[name=period]")).to_have_value("week")
    expect(page.locator("#budget-form select[name=key]")).to_have_value(prefix)
    shot(page, "budget-form-error")

    page.locator("#budget-form input[name=soft_limit_tokens]").fill("50")
    page.locator("#budget-form button[type=submit]").click()
    expect(page.locator("#flash")).to_have_text("Budget set: key web, 100 tokens per week.")
    expect(page.locator(f'tr[data-budget="{prefix}-week"] td').first).to_have_text(f"key web ({prefix})")
    page.reload()
    expect(page.locator("#flash")).to_have_count(0)  # shown once

    field = page.locator("#max-tokens-form input[name=default_max_tokens]")
    field.fill("-3")
    page.locator("#max-tokens-form button[type=submit]").click()
    expect(page.locator("#max-tokens-form [role=alert]")).to_contain_text("positive number")
    expect(field).to_have_value("-3")
    field.fill("7")
    page.locator("#max-tokens-form button[type=submit]").click()
    expect(page.locator("#flash")).to_contain_text("up to 7 tokens")
    assert admin_api(server, "GET", "/tenants/shop")["default_max_tokens"] == 7
    client = openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            extra_body={"ignore_eos": True})  # no max_tokens: the tenant's
    assert answer.usage.completion_tokens == 7

    submit_confirmed(page, page.get_by_role("button", name="Disable tenant"), accept=True)
    expect(page.locator(f'#keys tr[data-prefix="{prefix}"] .badge')).to_have_text("disabled")
    shot(page, "disabled-tenant-keys")
    # the only errors: Chromium logs each refused form's 400 page as a failed load
    assert page.errors == ["Failed to load resource: the server responded with a status of 400 (Bad Request)"] * 2


def test_the_overview_adds_prices_lists_adapters_and_draws_live_charts(page: Page, server, tmp_path):
    from tests.e2e.test_serve_models import peft_dir

    admin_api(server, "POST", "/tenants", name="lively")
    key = admin_api(server, "POST", "/tenants/lively/keys")["key"]
    admin_api(server, "POST", "/tenants/lively/adapters", name="tuned", base_model=MODEL, path=peft_dir(tmp_path, 5))
    admin_api(server, "POST", "/tenants", name="capped")
    capped = admin_api(server, "POST", "/tenants/capped/keys")["key"]
    admin_api(server, "POST", "/budgets", tenant="capped", period="week", limit_tokens=1)
    log_in(page, server)

    price = page.locator("#price-form")
    price.locator("input[name=input_per_1m]").fill("abc")
    price.locator("input[name=cached_input_per_1m]").fill("0.5")
    price.locator("input[name=output_per_1m]").fill("2")
    price.locator("button[type=submit]").click()
    expect(page.locator("#price-form [role=alert]")).to_be_visible()
    expect(page.locator("#price-form input[name=input_per_1m]")).to_have_value("abc")
    expect(page.locator("#price-form input[name=output_per_1m]")).to_have_value("2")
    page.locator("#price-form input[name=input_per_1m]").fill("1")
    page.locator("#price-form button[type=submit]").click()
    expect(page.locator("#flash")).to_contain_text(f"Price added for {MODEL}")

    requests_line = page.locator('svg[data-chart="requests"] path.line')
    expect(requests_line).to_have_count(1)  # drawn from the first poll
    before = requests_line.get_attribute("d")
    for _ in range(3):
        ask(key, server), ask(key, server, "tuned")
    with pytest.raises(openai.RateLimitError):
        ask(capped, server)
    # the sampler reads every 5 s and the page polls as often: the lines change without a reload
    page.wait_for_function("([sel, before]) => document.querySelector(sel).getAttribute('d') !== before",
                           arg=['svg[data-chart="requests"] path.line', before], timeout=30_000)
    expect(page.locator('svg[data-chart="requests"] path.line[data-max]:not([data-max="0"])')).to_have_count(
        1, timeout=30_000)
    expect(page.locator('svg[data-chart="ttft"] path.line[data-series="p50"]:not([data-max="0"])')).to_have_count(1)
    expect(page.locator('svg[data-chart="tokens"] path.line[data-series="output"]:not([data-max="0"])')) \
        .to_have_count(1)
    # the 429 came after the asks, so it may land one sample (and one poll) after the lines first moved
    expect(page.locator('#rejections tr[data-reason="budget (tenant)"] td').nth(1)).to_have_text("1", timeout=30_000)
    expect(page.locator("#live-status")).to_contain_text("updated")

    page.reload()
    expect(page.locator('#adapter-list tr[data-adapter="lively/tuned"] [data-residency]')).to_have_text("device")
    shot(page, "overview-live")
    assert page.errors == ["Failed to load resource: the server responded with a status of 400 (Bad Request)"]
