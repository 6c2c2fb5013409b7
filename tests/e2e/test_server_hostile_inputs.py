"""The real `loraplex serve` process against a hostile tenant: bodies past LORAPLEX_MAX_BODY_BYTES
(announced or streamed), values that make libraries raise, bodies nested past the recursion
limit, 200 unknown model names of 1 MB (the process's memory does not grow), and a flood of bad
keys from one address (429 once LORAPLEX_AUTH_MAX_FAILURES is used up). Normal requests beside
them are served. The throttle test runs last: it locks this machine's address out."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import admin_request, serving, tenant_key

ADMIN = "e2e-admin-token"
LIMIT = 1_500_000
MB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"LORAPLEX_MAX_BODY_BYTES": str(LIMIT), "LORAPLEX_AUTH_MAX_FAILURES": "5"}
    with serving(tmp_path_factory.mktemp("data"), ADMIN, env) as srv:
        yield srv


@pytest.fixture(scope="module")
def key(server) -> str:
    return tenant_key(server, ADMIN, "hostile")


def call(server, key: str, body: dict | None = None, content: bytes | None = None, **kwargs) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, content=content, headers=headers,
                      timeout=60, **kwargs)


def chat(model: str = "synthetic:tiny", content: str = "hi") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert code is None or err["code"] == code, err
    assert param is None or err["param"] == param, err
    return err


def served(server, key: str) -> None:
    assert call(server, key, chat()).status_code == 200


def test_bodies_past_the_limit_answer_413_announced_or_streamed(server, key):
    error(call(server, key, chat(content="x" * LIMIT)), 413, "request_too_large")

    def chunks():
        for _ in range(LIMIT // 65536 + 2):
            yield b" " * 65536  # no content-length: the limit counts what arrives

    error(call(server, key, content=chunks()), 413, "request_too_large")
    served(server, key)


def test_values_that_make_libraries_raise_are_a_400(server, key):
    for period in ("0000-01", "9999-12-31"):
        r = httpx.get(f"{server.base_url}/v1/usage", params={"period": period},
                      headers={"authorization": f"Bearer {key}"}, timeout=30)
        error(r, 400, param="period")
    nested = b'{"model": "synthetic:tiny", "messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error(call(server, key, content=nested), 400, "too_deeply_nested")
    arguments = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": "[" * 50_000}}]}
    body = {**chat(), "messages": [{"role": "user", "content": "hi"}, arguments]}
    error(call(server, key, body), 400, param="messages[1].tool_calls[0].function.arguments")
    tenant = f"hostile-{secrets.token_hex(4)}"
    admin_request(server, ADMIN, "POST", "/tenants", json={"name": tenant})
    r = httpx.post(f"{server.base_url}/admin/api/tenants/{tenant}/keys", json={"expires_in_s": 10**10},
                   headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    error(r, 400, param="expires_in_s")
    served(server, key)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_huge_unknown_model_names_do_not_grow_the_process(server, key):
    with httpx.Client(timeout=60) as client:
        headers = {"authorization": f"Bearer {key}"}

        def ask(i: int) -> None:
            r = client.post(f"{server.base_url}/v1/chat/completions", json=chat(f"{i}" + "m" * MB), headers=headers)
            assert len(error(r, 404, "model_not_found", "model")["message"]) < 300

        for i in range(20):  # warm-up: buffers the server keeps for bodies of this size
            ask(i)
        before = _rss(server.proc.pid)
        for i in range(200):
            ask(i)
        grown = _rss(server.proc.pid) - before
    assert grown < 100 * MB, f"the server grew {grown / MB:.0f} MB over 200 unknown 1 MB names"
    served(server, key)


def test_failed_authentication_from_one_address_is_throttled(server, key):
    for _ in range(5):
        error(call(server, f"lpx-{secrets.token_hex(20)}", chat()), 401, "invalid_api_key")
    r = call(server, f"lpx-{secrets.token_hex(20)}", chat())
    error(r, 429, "too_many_auth_failures")
    assert int(r.headers["retry-after"]) > 0
    error(call(server, key, chat()), 429, "too_many_auth_failures")  # locked, whatever it sends
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
