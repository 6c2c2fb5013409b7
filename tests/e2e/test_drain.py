"""SIGTERM drains the real `loraplex serve` (embedded SQLite): /ready turns 503, new generations
get a 503 with retry-after, the streams in flight run to their end (or, past the drain timeout,
are aborted and billed what they generated), their usage is in the ledger, and the exit status is 0."""

from __future__ import annotations

import signal
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import Server, admin_request, start
from tests.e2e.test_cli_platform import EMBEDDED

ADMIN = "e2e-drain-admin-token"
LONG = 2000  # tokens: seconds of generation for the tiny model on a CPU


def _server(data: Path, drain_timeout_s: float) -> tuple[Server, dict]:
    env = {**EMBEDDED, "LORAPLEX_DATA_DIR": str(data), "LORAPLEX_ADMIN_TOKEN": ADMIN,
           "LORAPLEX_DRAIN_TIMEOUT": str(drain_timeout_s)}
    server = start(env)
    admin_request(server, ADMIN, "POST", "/tenants", json={"name": "acme"})
    key = admin_request(server, ADMIN, "POST", "/tenants/acme/keys", json={}).json()["key"]
    return server, {"authorization": f"Bearer {key}"}


def _body(stream: bool, max_tokens: int = LONG) -> dict:
    return {"model": "synthetic:tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


def _ledger(data: Path) -> dict[str, tuple[str, int]]:
    with sqlite3.connect(data / "loraplex.db") as db:
        rows = db.execute("SELECT request_id, status, completion_tokens FROM usage_ledger").fetchall()
    return {rid: (status, tokens) for rid, status, tokens in rows}


def _draining(server: Server, auth: dict) -> None:
    """What a client sees while the server drains."""
    deadline = time.monotonic() + 10
    while (ready := httpx.get(f"{server.base_url}/ready", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "never drained"
        time.sleep(0.02)
    assert ready.status_code == 503 and ready.json()["checks"]["shutdown"] == "draining"
    refused = httpx.post(f"{server.base_url}/v1/chat/completions", json=_body(False, 4), headers=auth, timeout=10)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert refused.json()["error"]["type"] == "service_unavailable"


def _stop(server: Server) -> int:
    try:
        return server.proc.wait(60)
    finally:
        server.stop()


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0(tmp_path):
    server, auth = _server(tmp_path, drain_timeout_s=120)
    try:
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=_body(True), headers=auth,
                          timeout=60) as r:
            rid = r.headers["x-request-id"]
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            _draining(server, auth)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and f'"completion_tokens":{LONG}' in rest[-2]  # ran to its end
        assert _stop(server) == 0
    finally:
        server.stop()
    assert _ledger(tmp_path)[rid] == ("ok", LONG)


def test_past_the_drain_timeout_requests_are_aborted_and_billed_what_they_generated(tmp_path):
    server, auth = _server(tmp_path, drain_timeout_s=0)  # (0: cut at once, long before they could finish)
    try:
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, f"{server.base_url}/v1/chat/completions", json=_body(False),
                                headers=auth, timeout=60)
            with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=_body(True), headers=auth,
                              timeout=60) as r:
                rid = r.headers["x-request-id"]
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                deadline = time.monotonic() + 20
                while admin_request(server, ADMIN, "GET", "/engine/stats").json()["requests"]["running"] < 2:
                    assert time.monotonic() < deadline and not whole.done(), "the second request never ran"
                    time.sleep(0.02)
                server.proc.send_signal(signal.SIGTERM)
                with pytest.raises(httpx.RemoteProtocolError):  # cut short: no [DONE]
                    for _ in lines:
                        pass
            cut = whole.result()
        assert cut.status_code == 503 and cut.json()["error"]["code"] == "server_shutting_down", cut.text
        assert _stop(server) == 0
    finally:
        server.stop()
    ledger = _ledger(tmp_path)
    assert set(ledger) == {rid, cut.headers["x-request-id"]}
    assert all(0 < tokens < LONG for _, tokens in ledger.values()), ledger


@pytest.mark.parametrize("args, env", [
    (["--drain-timeout", "nan"], {}), (["--drain-timeout", "-1"], {}),
    ([], {"LORAPLEX_DRAIN_TIMEOUT": "inf"}), ([], {"LORAPLEX_DRAIN_TIMEOUT": "1e9"}),
])
def test_a_drain_timeout_out_of_bounds_is_one_line(args, env, tmp_path, monkeypatch, capsys):
    from loraplex.cli.main import main
    from tests.e2e.server import free_port

    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--device", "cpu", "--port", str(free_port()), *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("loraplex: error: ") and "drain" in line.lower(), line
