"""`auto`'s calibration in the admin UI, in headless Chromium against the real `loraplex serve` with two
base models: requests for `auto` record their scores, the overview lists each model's share of the day,
and the calibrate form sets the pool's limits to what the admin API's dry run computes (a refused window
keeps what was typed)."""

from __future__ import annotations

import httpx
import openai
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.server import start
from tests.e2e.test_admin_ui_browser import ADMIN, log_in, shot
from tests.e2e.test_cli_platform import EMBEDDED

SMALL, LARGE = "synthetic:tiny:2", "synthetic:tiny"
PROMPTS = ["hi", "What is 2 + 2?", "Prove that there are infinitely many primes, step by step.",
           "Translate 'good morning' to French.", "Write a Python function that merges two sorted lists.",
           "If a train leaves at 3 pm at 60 km/h and another at 4 pm at 80 km/h, when does the second catch up?"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {**EMBEDDED, "LORAPLEX_DATA_DIR": str(tmp_path_factory.mktemp("data")), "LORAPLEX_ADMIN_TOKEN": ADMIN}
    srv = start(env, "--model", SMALL, "--no-demo")  # (start serves LARGE too)
    try:
        yield srv
    finally:
        srv.stop()


def admin(server, method: str, route: str, **body) -> dict:
    r = httpx.request(method, f"{server.base_url}/admin/api{route}", json=None if method == "GET" else body, timeout=60,
                      headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code < 300, r.text
    return r.json()


def limits(server) -> dict[str, float | None]:
    return {m["name"]: m["auto_max_complexity"] for m in admin(server, "GET", "/models")}


def test_the_overview_shows_auto_shares_and_calibrates_the_pool(page: Page, server):
    admin(server, "PATCH", f"/models/{SMALL}", auto_max_complexity=0.5)
    admin(server, "PATCH", f"/models/{LARGE}", auto_max_complexity=1.0)
    admin(server, "POST", "/tenants", name="auto-ui")
    key = admin(server, "POST", "/tenants/auto-ui/keys")["key"]
    client = openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)
    for prompt in PROMPTS * 2:
        client.chat.completions.create(model="auto", messages=[{"role": "user", "content": prompt}], max_tokens=2)

    log_in(page, server)
    rows = page.locator("#auto-share-table tbody tr[data-model]")
    expect(rows.first).to_be_visible()
    shown = {rows.nth(i).get_attribute("data-model"): float(rows.nth(i).get_attribute("data-share"))
             for i in range(rows.count())}
    assert set(shown) <= {SMALL, LARGE} and shown and abs(sum(shown.values()) - 1.0) < 0.01

    # a window the server refuses: the same page again, with the reason and what was typed
    form = page.locator("#calibrate-form")
    form.locator("input[name=strong_share]").fill("0.5")
    form.locator("input[name=since]").fill("forever")
    form.locator("button[type=submit]").click()
    expect(form.get_by_role("alert")).to_be_visible()
    expect(form.locator("input[name=strong_share]")).to_have_value("0.5")
    expect(form.locator("input[name=since]")).to_have_value("forever")
    assert limits(server) == {SMALL: 0.5, LARGE: 1.0}  # nothing changed

    want = admin(server, "POST", "/auto/calibrate", strong_share=0.5, since="1d", dry_run=True)["thresholds"]
    form.locator("input[name=since]").fill("1d")
    form.locator("button[type=submit]").click()
    expect(page).to_have_url(f"{server.base_url}/admin#auto-shares")
    assert limits(server)[SMALL] == want[SMALL] != 0.5
    shot(page, "auto-shares")
    assert [e for e in page.errors if "400" not in e] == []  # (the refused form's page is a 400)
