"""Fixtures of the admin UI's browser tests: Debian's Chromium through Playwright, a page per test on the
module's own `server` fixture (a real `loraplex serve`)."""

from __future__ import annotations

import pytest
from playwright.sync_api import sync_playwright


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
