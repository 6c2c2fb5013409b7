"""What an app shows to whom, and how it stops: /metrics only with the admin token and with no key
in its labels; a draining app (what `serve` does on SIGTERM) is not ready and refuses new
generations with a 503 in the OpenAI error format. The real process's drain: e2e/test_drain.py."""

from __future__ import annotations

import time

from litestar.testing import TestClient

from tests.integration.billing_support import ADMIN, new_tenant, set_budget

CHAT = {"model": "synthetic:tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _openai_error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def test_metrics_need_the_admin_token_and_name_no_key(backend):
    with TestClient(backend.app(), timeout=60) as client:
        tenant, _, key = new_tenant(client, "exposed")
        set_budget(client, tenant, 10_000, "day", key=key[:12], soft_limit_tokens=1)
        chat = client.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"})
        assert chat.status_code == 200, chat.text
        for headers in ({}, {"authorization": f"Bearer {key}"}, {"authorization": "Bearer wrong"},
                        {"authorization": ADMIN["authorization"].replace("Bearer", "Basic")}):
            r = client.get("/metrics", headers=headers)
            _openai_error(r, 401, "invalid_admin_token")
            assert "loraplex_" not in r.text
        reached = f'loraplex_budget_soft_limit_reached{{budget="key day",tenant="{tenant}"}} 1.0'
        deadline = time.monotonic() + 10  # (the reservation is settled just after the response)
        while reached not in (text := client.get("/metrics", headers=ADMIN).text) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reached in text
        assert "lpx-" not in text and key[4:12] not in text


def test_metrics_are_off_without_an_admin_token(backend):
    with TestClient(backend.app(admin_token=None), timeout=60) as client:
        for headers in ({}, {"authorization": "Bearer anything"}):
            _openai_error(client.get("/metrics", headers=headers), 403, "admin_disabled")


def test_a_draining_app_is_not_ready_and_refuses_new_generations(backend):
    with TestClient(backend.app(), timeout=60) as client:
        _, _, key = new_tenant(client, "draining")
        auth = {"authorization": f"Bearer {key}"}
        assert client.get("/ready").status_code == 200
        client.app.state.drain.draining = True
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["checks"]["shutdown"] == "draining"
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {**CHAT, "prompt": "hi"})):
            for headers in (auth, {}):  # refused before the key is read
                r = client.post(path, json=body, headers=headers)
                error = _openai_error(r, 503, "server_shutting_down")
                assert error["type"] == "service_unavailable" and r.headers["retry-after"] == "1"
                assert r.headers["x-request-id"].startswith("req_")
        assert client.get("/v1/models", headers=auth).status_code == 200  # reads still answer
        assert client.get("/health").status_code == 200
        assert client.get("/admin/api/tenants", headers=ADMIN).status_code == 200
