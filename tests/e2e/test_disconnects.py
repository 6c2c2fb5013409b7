"""16 streaming clients that leave mid-stream, on adapters and on the base model, over the real
`loraplex serve` (embedded SQLite): every KV block comes back and no request keeps running (so no
adapter slot stays held); the slots then serve more adapters than they hold at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e import test_serve_models as serve_models
from tests.e2e.server import admin_request, start
from tests.e2e.test_cli_platform import EMBEDDED

ADMIN = "e2e-disconnects-admin-token"
CLIENTS, SLOTS, ADAPTERS = 16, 4, 6  # more adapters than slots: a held slot would starve the others


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {**EMBEDDED, "LORAPLEX_DATA_DIR": str(tmp_path_factory.mktemp("data")), "LORAPLEX_ADMIN_TOKEN": ADMIN}
    srv = start(env, "--max-loras", str(SLOTS))
    try:
        yield srv
    finally:
        srv.stop()


def admin(server, method: str, path: str, **kwargs) -> httpx.Response:
    return admin_request(server, ADMIN, method, path, **kwargs)


@pytest.fixture(scope="module")
def tenant(server, tmp_path_factory):
    """A key and the names of ADAPTERS adapters of its tenant."""
    admin(server, "POST", "/tenants", json={"name": "leavers"})
    key = admin(server, "POST", "/tenants/leavers/keys", json={}).json()["key"]
    root = tmp_path_factory.mktemp("peft")
    names = [f"a{i}" for i in range(ADAPTERS)]
    for i, name in enumerate(names):
        admin(server, "POST", "/tenants/leavers/adapters",
              json={"name": name, "base_model": "synthetic:tiny", "path": serve_models.peft_dir(root, seed=i + 1)})
    return {"authorization": f"Bearer {key}"}, names


def _chat(model: str, max_tokens: int, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


def _stats(server) -> dict:
    return admin(server, "GET", "/engine/stats").json()


def _disconnects(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    return next(float(x.split()[1]) for x in text.splitlines() if x.startswith("loraplex_client_disconnects_total "))


def test_sixteen_clients_leaving_mid_stream_free_every_block_and_slot(server, tenant):
    auth, adapters = tenant
    baseline, left_before = _stats(server), _disconnects(server)
    assert baseline["requests"]["running"] == baseline["requests"]["waiting"] == 0
    models = [adapters[i % SLOTS] if i % 2 else "synthetic:tiny" for i in range(CLIENTS)]  # half on 4 adapters
    all_streaming = threading.Barrier(CLIENTS, timeout=60)

    def leave_mid_stream(model: str) -> int:
        with httpx.Client(base_url=server.base_url, headers=auth, timeout=60) as client, \
                client.stream("POST", "/v1/chat/completions", json=_chat(model, 1000, True)) as r:
            assert r.status_code == 200, r.read()
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            all_streaming.wait()  # every client mid-stream at once, then all leave
            return seen

    with ThreadPoolExecutor(CLIENTS) as pool:
        assert list(pool.map(leave_mid_stream, models)) == [3] * CLIENTS
    deadline = time.monotonic() + 5
    while (now := _stats(server))["requests"]["running"] or now["requests"]["waiting"] \
            or now["kv"]["blocks_used"] > baseline["kv"]["blocks_used"]:
        assert time.monotonic() < deadline, f"not freed within 5 s: {now}"
        time.sleep(0.05)
    assert now["kv"]["blocks_used"] == baseline["kv"]["blocks_used"] == 0
    assert _disconnects(server) == left_before + CLIENTS  # each ended by its client leaving, not by finishing
    for model in adapters:  # ADAPTERS > SLOTS: each needs a slot the earlier requests left
        done = httpx.post(f"{server.base_url}/v1/chat/completions", json=_chat(model, 4, False), headers=auth,
                          timeout=30)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4, done.text
