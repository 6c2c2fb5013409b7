"""`loraplex serve --ray auto --replicas 2` on Postgres + Redis: the gateway starts a real local Ray cluster and runs
two engine replicas as a Serve deployment; driven with the `openai` client, the API answers as with an engine of its
own, an adapter's requests stay on one replica, deleting it reaches every replica, a killed replica's requests are
served by the other, and bad options fail in one line."""

from __future__ import annotations

import secrets
import time

import httpx
import openai
import pytest
import ray

from tests.conftest import one_ray_cluster
from tests.e2e.server import admin_request, postgres_redis_env, start
from tests.e2e.test_cli_platform import loraplex

ADMIN = "e2e-ray-admin-token"
MODEL = "synthetic:tiny"


@pytest.fixture(scope="module", autouse=True)
def _the_machines_one_ray_cluster():
    """Every test here starts or joins a local Ray cluster: none runs beside another module's (set up first,
    torn down last)."""
    with one_ray_cluster():
        yield


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with postgres_redis_env(tmp_path_factory.mktemp("data"), ADMIN) as env:
        env = {**env, "RAY_USAGE_STATS_ENABLED": "0"}
        server = start(env, "--ray", "auto", "--replicas", "2", "--replica-cpus", "0.5", timeout_s=300)
        try:
            yield server
        finally:
            server.stop()


def admin(server, method: str, path: str, **kwargs) -> httpx.Response:
    return admin_request(server, ADMIN, method, path, **kwargs)


@pytest.fixture(scope="module")
def tenant(gateway):
    name = f"ray-{secrets.token_hex(3)}"
    admin(gateway, "POST", "/tenants", json={"name": name})
    key = admin(gateway, "POST", f"/tenants/{name}/keys", json={}).json()["key"]
    return name, openai.OpenAI(api_key=key, base_url=f"{gateway.base_url}/v1", max_retries=0, timeout=60)


def ask(client: openai.OpenAI, model: str, content: str = "hello ray") -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=10, temperature=0, extra_body={"ignore_eos": True})


def replicas(server, want: int = 2, timeout_s: float = 30, until=lambda listed: True) -> list[dict]:
    """The replicas the admin API lists, once `want` answer and `until` holds (the status is polled each second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = admin(server, "GET", "/engine/replicas").json()
        if (len(listed) == want and until(listed)) or time.monotonic() > deadline:
            return listed
        time.sleep(0.3)


def wait_until_gone(actor_name: str, timeout_s: float = 60) -> None:
    """Until the named actor is dead: its name is released then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(actor_name, namespace="serve")
        except ValueError:
            return
        time.sleep(0.2)
    pytest.fail(f"{actor_name} was still alive {timeout_s:g} s after ray.kill")


def test_chat_streaming_usage_and_replicas(gateway, tenant):
    _, client = tenant
    assert MODEL in {m.id for m in client.models.list()}
    whole = ask(client, MODEL)
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello ray"}], max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True}, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    listed = replicas(gateway, until=lambda ws: sum(w["requests"] for w in ws) >= 2)
    assert len(listed) == 2 and all(w["models"] == [MODEL] and w["adapters"] == [] for w in listed)
    assert sum(w["requests"] for w in listed) >= 2
    stats = admin(gateway, "GET", "/engine/stats").json()
    assert stats["requests"]["generated_tokens"] >= 20 and stats["kv"]["blocks_total"] > 0  # summed over both replicas
    assert httpx.get(f"{gateway.base_url}/ready").status_code == 200
    with httpx.Client(base_url=gateway.base_url) as browser:  # the admin overview lists them too
        assert browser.post("/admin/login", data={"token": ADMIN, "next": "/admin"}).status_code == 303
        page = browser.get("/admin").text
    assert all(f'data-replica="{w["replica"]}"' in page for w in listed)
    metrics = httpx.get(f"{gateway.base_url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    assert all(f'loraplex_replica_running{{replica="{w["replica"]}"}}' in metrics for w in listed)


def test_each_adapter_stays_on_one_replica_and_deletions_reach_every_one(gateway, tenant, tmp_path):
    """Six adapters, three requests each, one at a time (under the load bound): each is registered on one replica
    only (how rendezvous ranking spreads keys over replicas: tests/unit/test_ray_serve_plan.py)."""
    from tests.conftest import _loaded
    from tests.lora_factory import make_peft_dir

    name, client = tenant
    names = [f"tuned{i}" for i in range(6)]
    for i, adapter in enumerate(names):
        path = make_peft_dir(tmp_path / adapter, _loaded(MODEL).config, rank=8, alpha=16, targets="all", seed=5 + i)
        made = admin(gateway, "POST", f"/tenants/{name}/adapters",
                     json={"name": adapter, "base_model": MODEL, "path": str(path)})
        assert made.status_code == 201, made.text
    base = ask(client, MODEL).choices[0].message.content
    for adapter in names:
        answers = {ask(client, adapter).choices[0].message.content for _ in range(3)}
        assert len(answers) == 1 and answers != {base}
    listed = replicas(gateway, until=lambda ws: sum(len(w["adapters"]) for w in ws) >= 6)
    held = [a for w in listed for a in w["adapters"]]
    assert len(held) == len(set(held)) == 6  # each on exactly one replica, for all its requests
    for adapter in names:
        assert admin(gateway, "DELETE", f"/tenants/{name}/adapters/{adapter}").status_code == 204
    listed = replicas(gateway, until=lambda ws: sum(len(w["adapters"]) for w in ws) == 0)
    assert [w["adapters"] for w in listed] == [[], []]
    with pytest.raises(openai.NotFoundError):
        ask(client, names[0])


def test_a_killed_replica_is_replaced_and_requests_go_on(gateway, tenant):
    """The test joins the gateway's local cluster (the newest on this machine) and kills one replica's actor."""
    _, client = tenant
    assert any("2 engine replicas on the Ray cluster at" in line for line in gateway.stdout), gateway.stdout
    ray.init(address="auto", namespace="serve", logging_level="ERROR", log_to_driver=False)
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if "EngineReplica" in a["name"] and a["namespace"] == "serve"]
        assert len(names) == 2, names
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        # ray.kill returns before the actor is down: a request started there first would be cut off (a 503 by design)
        wait_until_gone(names[0])
        for i in range(4):  # served by the other replica (a request caught on the dead one is sent again)
            try:
                assert ask(client, MODEL, f"after the kill {i}").usage.completion_tokens == 10
            except openai.APIError as exc:
                log = "\n".join(gateway.stdout[-40:])
                pytest.fail(f"request {i} after the kill: {exc}; the gateway's log ends:\n{log}")
        assert httpx.get(f"{gateway.base_url}/ready").status_code == 200
        killed = names[0].rsplit("#", 1)[-1]  # (SERVE_REPLICA::<app>#<deployment>#<replica id>)
        listed = replicas(gateway, timeout_s=120, until=lambda ws: all(w["replica"] != killed for w in ws))
        assert len(listed) == 2  # Serve started a replacement
    finally:
        ray.shutdown()


def test_bad_ray_options_fail_in_one_line(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path)}
    cases = [
        (("serve", "--replicas", "2"), "--replicas: these size the Ray Serve replicas; give --ray too"),
        (("serve", "--ray", "--min-replicas", "3", "--max-replicas", "2"), "--min-replicas 3 is above --max-"),
        (("serve", "--ray", "--replicas", "2", "--max-replicas", "4"), "--replicas is a fixed count"),
        (("serve", "--ray", "--replicas", "0"), "--replicas must be in 1..1024"),
        (("serve", "--ray", "ray://head:10001"), "Ray Client (ray://) cannot stream responses from Serve"),
    ]
    for args, message in cases:
        out = loraplex(env, *args)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("loraplex: error:") and message in lines[0], out.stderr
