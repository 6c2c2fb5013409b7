"""`loraplex serve` on the embedded defaults and the tenant/key/model commands, as real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.server import start

EMBEDDED = {"LORAPLEX_DATABASE_URL": "", "LORAPLEX_REDIS_URL": "", "LORAPLEX_ADMIN_TOKEN": ""}


def loraplex(env: dict, *args: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "loraplex.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **EMBEDDED, **env}, timeout=120)


def one_line_error(out: subprocess.CompletedProcess, needle: str) -> None:
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loraplex: error:") and needle in lines[0], out.stderr


def models(server, key: str) -> int:
    return httpx.get(f"{server.base_url}/v1/models", headers={"authorization": f"Bearer {key}"}).status_code


@pytest.fixture(scope="module")
def data_env(tmp_path_factory):
    return {"LORAPLEX_DATA_DIR": str(tmp_path_factory.mktemp("embedded"))}


def test_two_demo_starts_leave_one_live_limited_demo_key(data_env):
    first = start({**EMBEDDED, **data_env}, "--demo")
    try:
        (key1,) = first.demo_keys
        assert key1.startswith("lpx-") and models(first, key1) == 200
    finally:
        first.stop()
    second = start({**EMBEDDED, **data_env}, "--demo")
    try:
        (key2,) = second.demo_keys
        assert key2 != key1 and models(second, key2) == 200
        assert models(second, key1) == models(second, "lpx-not-a-real-key-at-all-00000000") == 401
    finally:
        second.stop()
    listed = loraplex(data_env, "keys", "list", "--tenant", "demo")
    assert listed.returncode == 0, listed.stderr
    header, *lines = listed.stdout.splitlines()
    assert header.startswith("PREFIX") and "MAX PRIORITY" in header and "EXPIRES AT" in header
    state_at = header.index("STATE")  # aligned: each row's state starts under its header
    assert len(lines) == 2 and sorted(line[state_at:].split()[0] for line in lines) == ["active", "revoked"]
    rows = json.loads(loraplex(data_env, "keys", "list", "--tenant", "demo", "--json").stdout)
    live = [r for r in rows if r["state"] != "revoked"]
    assert len(rows) == 2 and len(live) == 1 and live[0]["prefix"] == key2[:12]
    assert live[0]["max_priority"] == "standard" and live[0]["expires_at"]  # not realtime, not forever
    budgets = loraplex(data_env, "budgets", "list", "--tenant", "demo")
    assert budgets.returncode == 0 and key2[:12] in budgets.stdout, budgets


def test_serve_makes_no_demo_key_unless_asked(data_env):
    server = start({**EMBEDDED, **data_env})
    try:
        assert not server.demo_keys
    finally:
        server.stop()


def test_tenant_key_and_model_commands(data_env):
    created = loraplex(data_env, "tenants", "create", "acme", "--tier", "gold")
    assert created.returncode == 0, created.stderr
    one_line_error(loraplex(data_env, "tenants", "create", "acme"), "already exists")
    made = loraplex(data_env, "keys", "create", "--tenant", "acme", "--rpm", "5")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]
    assert key.startswith("lpx-") and len(key) > 40
    one_line_error(loraplex(data_env, "keys", "create", "--tenant", "nobody"), "not found")
    listed = loraplex(data_env, "models", "list")
    assert listed.returncode == 0 and "synthetic:tiny" in listed.stdout  # registered by the server above
    server = start({**EMBEDDED, **data_env}, "--no-demo")
    try:
        assert not server.demo_keys and models(server, key) == 200
        revoked = loraplex(data_env, "keys", "revoke", key[:12])
        assert revoked.returncode == 0 and key[:12] in revoked.stdout
        time.sleep(1.0)
        assert models(server, key) == 401  # revoked by another process, refused within a second
    finally:
        server.stop()
    one_line_error(loraplex(data_env, "keys", "revoke", "lpx-nothing0"), "no key")


def test_commands_need_a_migrated_database_and_serve_checks_its_port(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path)}
    one_line_error(loraplex(env, "tenants", "create", "x"), "loraplex db upgrade")
    up = loraplex(env, "db", "upgrade")
    assert up.returncode == 0 and "at revision" in up.stdout
    assert loraplex(env, "tenants", "create", "x").returncode == 0
    one_line_error(loraplex(env, "serve", "--model", "synthetic:tiny", "--port", "0"), "--port")
