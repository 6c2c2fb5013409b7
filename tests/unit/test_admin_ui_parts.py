"""The admin UI's pure parts: the SVG chart carries exactly the numbers it is given (escaped), and
the session cookie and CSRF tokens hold only for the token, time and cookie they were made for."""

from __future__ import annotations

import re

import pytest

from loraplex.admin_ui import session
from loraplex.admin_ui.charts import HEIGHT, Series, stacked_bars
from loraplex.platform.admin.api import admin_token_ok


def bars(svg: str) -> list[dict[str, str]]:
    return [dict(re.findall(r'data-([a-z]+)="([^"]*)"', g)) for g in re.findall(r'<g class="bar" ([^>]*)>', svg)]


def test_each_bar_carries_its_values_and_stacks_to_scale():
    svg = str(stacked_bars(["d1", "d2", "d3"], [Series("input tokens", "input", [10, 0, 30]),
                                                 Series("output tokens", "output", [30, 0, 10])], "Tokens"))
    assert bars(svg) == [{"label": "d1", "input": "10", "output": "30"}, {"label": "d2", "input": "0", "output": "0"},
                         {"label": "d3", "input": "30", "output": "10"}]
    heights = [float(h) for h in re.findall(r'<rect class="\w+" [^>]*height="([\d.]+)"', svg)]
    plot = heights[0] + heights[1]  # d1's stack is the tallest (40), so it spans the plot's whole height
    assert plot == pytest.approx(sum(heights[2:]), abs=0.2) and plot < HEIGHT
    assert heights[0] == pytest.approx(plot / 4, abs=0.2)  # 10 of 40
    assert "<title>d3: 30 input tokens, 10 output tokens</title>" in svg and len(heights) == 4  # no empty rects


def test_text_is_escaped_and_bad_input_refused():
    svg = str(stacked_bars(['<x>"'], [Series("a&b", "input", [1])], "<script>"))
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "a&amp;b" in svg
    assert 'data-label="&lt;x&gt;&quot;"' in svg
    assert str(stacked_bars([], [], "empty")).endswith("</svg>")
    with pytest.raises(ValueError):
        stacked_bars(["d1", "d2"], [Series("a", "input", [1])], "t")


def test_a_session_cookie_holds_for_its_token_and_lifetime_only():
    cookie = session.issue("token", now=1000)
    assert session.valid("token", cookie, now=1000 + session.SESSION_S - 1)
    assert not session.valid("token", cookie, now=1000 + session.SESSION_S)  # expired
    assert not session.valid("token", cookie, now=999)  # from the future
    assert not session.valid("other", cookie, now=1001)  # the admin token changed
    issued, nonce, mac = cookie.split(".")
    assert not session.valid("token", f"{int(issued) + 1}.{nonce}.{mac}", now=1001)  # tampered
    assert session.issue("token", now=1000) != cookie  # each login is its own session
    for bad in ("", "x", ".", "1000.", "1000..", f"{issued}.{mac}", None):
        assert not session.valid("token", bad, now=1001)
    assert not session.valid(None, cookie, now=1001)


def test_csrf_tokens_belong_to_one_session():
    a, b = session.issue("token", 1000), session.issue("token", 1001)
    assert session.csrf_ok("token", a, session.csrf_token("token", a))
    assert not session.csrf_ok("token", b, session.csrf_token("token", a))
    assert not session.csrf_ok("token", a, None) and not session.csrf_ok("token", a, "")
    assert admin_token_ok("token", " token ") and not admin_token_ok("token", "tokem")
    assert not admin_token_ok(None, "")
