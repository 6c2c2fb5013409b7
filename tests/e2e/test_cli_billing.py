"""Budgets, prices and billing exports as an operator and a tenant meet them: the `loraplex`
commands, the real server on the embedded defaults driven with the `openai` client (a budget
refusal, a client leaving mid-stream), and exports from the command line and the admin API.

Most commands run in this process through `loraplex.cli.main.main` (a new process pays seconds of
imports each time); the export that writes a file runs as a real process."""

from __future__ import annotations

import contextlib
import io
import json
import time
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest

from loraplex.cli.main import main
from tests.e2e.server import start
from tests.e2e.test_cli_platform import EMBEDDED, loraplex, one_line_error

ADMIN = "billing-e2e-admin"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**EMBEDDED, "LORAPLEX_DATA_DIR": str(tmp_path_factory.mktemp("billing")), "LORAPLEX_ADMIN_TOKEN": ADMIN}


def cli(monkeypatch, env: dict, *args: str) -> tuple[int, str, str]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def ok(result: tuple[int, str, str]) -> str:
    code, out, err = result
    assert code == 0, err
    return out


def refused(result: tuple[int, str, str], needle: str) -> None:
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("loraplex: error:") and needle in lines[0], err


def _admin(server, path: str, **params) -> httpx.Response:
    r = httpx.get(f"{server.base_url}/admin/api{path}", params=params, headers={"authorization": f"Bearer {ADMIN}"},
                  timeout=30)
    assert r.status_code == 200, r.text
    return r


def _settled(server, tenant: str) -> list[dict]:
    """The tenant's budgets once nothing is reserved and the counters equal the ledger."""
    deadline = time.monotonic() + 30
    while True:
        listed = _admin(server, "/budgets", tenant=tenant).json()
        if all(b["counter_reserved_tokens"] == 0 and b["counter_used_tokens"] == b["used_tokens"] for b in listed):
            return listed
        assert time.monotonic() < deadline, listed
        time.sleep(0.1)


def test_budgets_prices_and_exports_with_a_live_server(monkeypatch, env, tmp_path):
    server = start(env, "--no-demo")
    try:
        ok(cli(monkeypatch, env, "tenants", "create", "acme", "--default-max-tokens", "16"))
        keys = [ok(cli(monkeypatch, env, "keys", "create", "--tenant", "acme")).strip().splitlines()[-1]
                for _ in range(2)]
        ok(cli(monkeypatch, env, "budgets", "set", "--tenant", "acme", "--key", keys[0][:12], "--limit-tokens", "80",
               "--period", "month", "--soft-limit-tokens", "40"))
        ok(cli(monkeypatch, env, "budgets", "set", "--tenant", "acme", "--limit-tokens", "100000", "--period", "total"))
        effective = datetime.now(UTC) + timedelta(seconds=3)  # the CLI refuses a start in the past
        when = effective.isoformat()
        ok(cli(monkeypatch, env, "prices", "set", "--model", "synthetic:tiny", "--input-per-1m", "1.5",
               "--cached-input-per-1m", "0.5", "--output-per-1m", "6", "--effective-from", when))
        (price,) = json.loads(ok(cli(monkeypatch, env, "prices", "list", "--json")))
        assert price["model"] == "synthetic:tiny" and (price["currency"], price["input_per_1m"]) == ("USD", "1.50")
        # requests from now on fall under that price
        time.sleep(max(0.0, (effective - datetime.now(UTC)).total_seconds()) + 0.05)

        capped = openai.OpenAI(api_key=keys[0], base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)
        with pytest.raises(openai.RateLimitError) as info:
            for _ in range(20):
                capped.completions.create(model="synthetic:tiny", prompt="hello world", max_tokens=10)
        assert info.value.code == "insufficient_quota" and "budget" in info.value.message

        free = openai.OpenAI(api_key=keys[1], base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)
        stream = free.chat.completions.create(model="synthetic:tiny", messages=[{"role": "user", "content": "go"}],
                                              max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
        for received, _ in enumerate(stream, 1):
            if received == 3:
                break
        stream.close()  # leaves mid-stream: the rest of its reservation goes back
        budgets = {b["period"]: b for b in _settled(server, "acme")}
        month, total = budgets["month"]["used_tokens"], budgets["total"]["used_tokens"]
        assert month <= 80 and total > month

        period = datetime.now(UTC).strftime("%Y-%m")
        target = tmp_path / "acme.csv"
        done = loraplex(env, "billing", "export", "--period", period, "--tenant", "acme", "--output", str(target))
        assert done.returncode == 0 and "wrote" in done.stderr, done.stderr
        over_api = _admin(server, "/billing/export", period=period, tenant="acme").content
        assert target.read_bytes() == over_api
        rows = [line.split(",") for line in target.read_text().splitlines()]
        totals = next(r for r in rows if r[0] == "total")
        assert int(totals[7]) >= 3 and totals[6] == "USD" and float(totals[-1]) > 0
        detail = ok(cli(monkeypatch, env, "billing", "export", "--period", period, "--format", "jsonl", "--detail"))
        assert detail == ok(cli(monkeypatch, env, "billing", "export", "--period", period, "--format", "jsonl",
                                "--detail"))
        assert '"status":"client_disconnected"' in detail and detail.count('"record":"request"') == int(totals[7])
    finally:
        server.stop()


def test_bad_input_is_one_line_and_changes_nothing(monkeypatch, env, tmp_path):
    ok(cli(monkeypatch, env, "db", "upgrade"))
    ok(cli(monkeypatch, env, "tenants", "create", "careful"))
    ok(cli(monkeypatch, env, "models", "add", "careful-model"))
    budget = ("budgets", "set", "--tenant", "careful", "--period", "day")
    refused(cli(monkeypatch, env, *budget, "--limit-tokens", "lots"), "--limit-tokens")
    refused(cli(monkeypatch, env, *budget, "--limit-tokens", "0"), "--limit-tokens")
    refused(cli(monkeypatch, env, *budget, "--limit-tokens", "5", "--soft-limit-tokens", "6"), "soft_limit_tokens")
    refused(cli(monkeypatch, env, "budgets", "set", "--tenant", "careful", "--period", "fortnight",
                "--limit-tokens", "5"), "period")
    refused(cli(monkeypatch, env, *budget, "--limit-tokens", "5", "--key", "lpx-unknown0"), "no key")
    refused(cli(monkeypatch, env, *budget, "--limit-tokens", "5", "--tenant", "nobody"), "not found")
    assert json.loads(ok(cli(monkeypatch, env, "budgets", "list", "--tenant", "careful", "--json"))) == []
    price = ("prices", "set", "--model", "careful-model", "--input-per-1m", "1", "--cached-input-per-1m", "1",
             "--output-per-1m", "1")
    refused(cli(monkeypatch, env, *price, "--currency", "dollars"), "currency")
    refused(cli(monkeypatch, env, *price, "--effective-from", "2001-01-01"), "past")
    refused(cli(monkeypatch, env, *price, "--effective-from", "soon"), "--effective-from")
    refused(cli(monkeypatch, env, *price[:4], "--input-per-1m", "-1", *price[6:]), "input_per_1m")
    refused(cli(monkeypatch, env, *price[:3], "nothing-like-it", *price[4:]), "not registered")
    assert json.loads(ok(cli(monkeypatch, env, "prices", "list", "--model", "careful-model", "--json"))) == []
    refused(cli(monkeypatch, env, "billing", "export", "--period", "2026-13"), "period")
    refused(cli(monkeypatch, env, "billing", "export", "--period", "2026-11", "--format", "xml"), "format")
    refused(cli(monkeypatch, env, "billing", "export", "--period", "2026-11", "--tenant", "nobody"), "not found")
    target = tmp_path / "never.csv"
    refused(cli(monkeypatch, env, "billing", "export", "--period", "2026-11", "--tenant", "nobody", "--output",
                str(target)), "not found")
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    refused(cli(monkeypatch, env, "billing", "export", "--period", "2026-11", "--output", "/no/such/dir/x.csv"),
            "does not exist")
    refused(cli(monkeypatch, env, "tenants", "update", "careful", "--default-max-tokens", "0"), "--default-max-tokens")
    one_line_error(loraplex(env, "budgets", "set", "--tenant", "careful", "--period", "month", "--limit-tokens",
                            "-5"), "--limit-tokens")  # and as a real process
