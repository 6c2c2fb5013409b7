"""`loraplex serve --worker URL --worker URL` on Postgres + Redis over two real `loraplex worker`
processes holding a token, driven with the `openai` client: the API answers as with an engine of its
own, an adapter's requests stay on one worker, usage is recorded, and bad fleet options fail in one line."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.e2e.server import admin_request, postgres_redis_env, start, start_worker

ADMIN = "e2e-fleet-admin-token"
TOKEN = {"LORAPLEX_WORKER_TOKEN": "e2e-fleet-worker-token"}
MODEL = "synthetic:tiny"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with postgres_redis_env(tmp_path_factory.mktemp("data"), ADMIN) as env:
        workers = [start_worker(TOKEN)]
        try:
            workers.append(start_worker(TOKEN))
            server = start({**env, **TOKEN}, *(arg for w in workers for arg in ("--worker", w.base_url)))
            try:
                yield server, workers
            finally:
                server.stop()
        finally:
            for w in workers:
                w.stop()


def admin(server, method: str, path: str, **kwargs) -> httpx.Response:
    return admin_request(server, ADMIN, method, path, **kwargs)


def worker_stats(worker) -> dict:
    headers = {"authorization": f"Bearer {TOKEN['LORAPLEX_WORKER_TOKEN']}"}
    return httpx.get(f"{worker.base_url}/engine/health", headers=headers).json()["stats"]


@pytest.fixture(scope="module")
def tenant(fleet):
    server, _ = fleet
    name = f"fleet-{secrets.token_hex(3)}"
    admin(server, "POST", "/tenants", json={"name": name})
    key = admin(server, "POST", f"/tenants/{name}/keys", json={}).json()["key"]
    return name, openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)


def ask(client: openai.OpenAI, model: str, content: str = "hello fleet") -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=10, temperature=0, extra_body={"ignore_eos": True})


def test_chat_streaming_and_usage_through_the_workers(fleet, tenant):
    server, workers = fleet
    _, client = tenant
    assert MODEL in {m.id for m in client.models.list()}
    whole = ask(client, MODEL)
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello fleet"}], max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True}, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    generated = sum(worker_stats(w)["generated_tokens"] for w in workers)
    assert generated >= 20
    deadline = time.monotonic() + 20
    while True:  # (the ledger is written in batches, off the request path)
        usage = httpx.get(f"{server.base_url}/v1/usage", headers={"authorization": f"Bearer {client.api_key}"}).json()
        totals = usage["totals"][0] if usage["totals"] else {"requests": 0, "output_tokens": 0}
        if totals["requests"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert totals["requests"] == 2 and totals["output_tokens"] == 20
    metrics = httpx.get(f"{server.base_url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    assert "loraplex_engine_requests_running" in metrics
    for w in workers:
        assert f'loraplex_worker_up{{worker="{w.base_url}"}} 1.0' in metrics
    sent = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("loraplex_worker_requests_total{")]
    assert sum(sent) == 2  # the two chat requests


def test_an_adapter_answers_from_one_worker(fleet, tenant, tmp_path):
    from tests.conftest import _loaded
    from tests.lora_factory import make_peft_dir

    server, workers = fleet
    name, client = tenant
    path = make_peft_dir(tmp_path / "tuned", _loaded(MODEL).config, rank=8, alpha=16, targets="all", seed=5)
    admin(server, "POST", f"/tenants/{name}/adapters", json={"name": "tuned", "base_model": MODEL, "path": str(path)})
    before = [worker_stats(w)["adapter_loads"] for w in workers]
    answers = {ask(client, "tuned").choices[0].message.content for _ in range(4)}
    loads = [worker_stats(w)["adapter_loads"] - b for w, b in zip(workers, before, strict=True)]
    assert len(answers) == 1 and answers != {ask(client, MODEL).choices[0].message.content}
    assert sorted(loads) == [0, 1]  # loaded once, by one worker, for all four requests


def test_operators_see_the_workers_in_the_admin_api_and_ui(fleet, tenant):
    server, workers = fleet
    ask(tenant[1], MODEL)
    listed = admin(server, "GET", "/engine/workers").json()
    assert [w["url"] for w in listed] == [w.base_url for w in workers]
    assert all(w["up"] and w["models"] == [MODEL] and w["in_flight"] == 0 for w in listed)
    assert sum(w["requests"] for w in listed) >= 1
    with httpx.Client(base_url=server.base_url) as browser:
        login = browser.post("/admin/login", data={"token": ADMIN, "next": "/admin"})
        assert login.status_code == 303, login.text
        page = browser.get("/admin").text
    assert 'id="workers"' in page
    for w in workers:
        assert re.search(rf'<tr data-worker="{re.escape(w.base_url)}"><td>[^<]+</td><td>up</td>', page)


def loraplex(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraplex.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_bad_fleet_options_fail_in_one_line(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path)}
    cases = [
        (("serve", "--worker", "http://127.0.0.1:9", "--model", MODEL), "--model: with --worker the workers run"),
        (("serve", "--worker", "http://127.0.0.1:9"), "no worker answers"),
        (("worker", "--host", "0.0.0.0", "--model", MODEL), "set LORAPLEX_WORKER_TOKEN"),
    ]
    for args, message in cases:
        out = loraplex(*args, env=env)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("loraplex: error:") and message in lines[0], out.stderr
