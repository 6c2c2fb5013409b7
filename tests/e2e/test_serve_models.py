"""`loraplex serve` with several base models (embedded SQLite), driven with the `openai` client:
both models answer through one API, multiplexed under a memory budget that holds one at a time;
an adapter serves on the model it was registered on; one deleted mid-stream finishes that stream."""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest

from tests.e2e.server import start

ADMIN = "e2e-models-admin-token"
FIRST, SECOND = "synthetic:tiny", "synthetic:tiny:2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"LORAPLEX_ADMIN_TOKEN": ADMIN, "LORAPLEX_DATA_DIR": str(tmp_path_factory.mktemp("data"))}
    # 30 MiB holds one tiny model with its adapter slots (17 + 8 MiB: weights, 16 MiB of KV cache)
    # but not two
    srv = start(env, "--model", SECOND, "--memory-budget-mb", "30")
    try:
        yield srv
    finally:
        srv.stop()


def admin(server, method: str, path: str, **kwargs) -> httpx.Response:
    r = httpx.request(method, f"{server.base_url}/admin/api{path}", headers={"authorization": f"Bearer {ADMIN}"},
                      timeout=30, **kwargs)
    assert r.status_code < 300, r.text
    return r


@pytest.fixture(scope="module")
def tenant(server):
    name = f"models-{secrets.token_hex(3)}"
    admin(server, "POST", "/tenants", json={"name": name})
    key = admin(server, "POST", f"/tenants/{name}/keys", json={}).json()["key"]
    return name, openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)


def ask(client: openai.OpenAI, model: str) -> str:
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "same prompt"}],
                                            max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert answer.model == model and answer.usage.completion_tokens == 12
    return answer.choices[0].message.content


def peft_dir(tmp_path, seed: int) -> str:
    from loraplex.engine.models.loader import load_model, resolve_model
    from tests.lora_factory import make_peft_dir

    config = load_model(resolve_model(FIRST)).config
    return str(make_peft_dir(tmp_path / f"peft{seed}", config, rank=8, alpha=16, targets="all", seed=seed))


def test_both_models_answer_through_one_api_one_resident_at_a_time(server, tenant):
    _, client = tenant
    assert {FIRST, SECOND} <= {m.id for m in client.models.list()}
    first, second = ask(client, FIRST), ask(client, SECOND)
    assert first != second  # two models, differently seeded
    assert (ask(client, FIRST), ask(client, SECOND)) == (first, second)
    stats = admin(server, "GET", "/engine/stats").json()
    assert stats["models"]["resident"] == 1 and stats["models"]["evictions"] >= 3 and stats["models"]["loads"] >= 4


def test_an_adapter_serves_on_its_own_base_model(server, tenant, tmp_path):
    name, client = tenant
    admin(server, "POST", f"/tenants/{name}/adapters",
          json={"name": "on-second", "base_model": SECOND, "path": peft_dir(tmp_path, 1)})
    tuned = ask(client, "on-second")
    assert tuned == ask(client, f"{SECOND}:on-second") and tuned != ask(client, SECOND)
    with pytest.raises(openai.NotFoundError):
        ask(client, f"{FIRST}:on-second")


def test_an_adapter_deleted_mid_stream_finishes_that_stream_then_is_gone(server, tenant, tmp_path):
    name, client = tenant
    admin(server, "POST", f"/tenants/{name}/adapters",
          json={"name": "leaving", "base_model": FIRST, "path": peft_dir(tmp_path, 2)})
    stream = client.chat.completions.create(
        model="leaving", messages=[{"role": "user", "content": "go"}], max_tokens=1500, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [next(stream), next(stream), next(stream)]
    admin(server, "DELETE", f"/tenants/{name}/adapters/leaving")
    assert admin(server, "GET", "/engine/stats").json()["requests"]["running"] == 1  # deleted while its request runs
    with pytest.raises(openai.NotFoundError) as info:
        ask(client, "leaving")
    assert info.value.code == "model_not_found"
    chunks.extend(stream)
    assert chunks[-1].usage.completion_tokens == 1500
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


@pytest.mark.parametrize(("args", "error"), [
    (["--model", FIRST, "--model", FIRST], "--model names a model twice"),
    (["--model", FIRST, "--memory-budget-mb", "0"], "--memory-budget-mb must be positive"),
    (["--model", FIRST, "--model", SECOND, "--memory-budget-mb", "4"], "whole model memory budget is 4 MiB"),
    (["--model", FIRST, "--lora-dtype", "int8"], "lora_dtype must be auto or one of"),
    (["--model", FIRST, "--weight-dtype", "int2"], "weight_dtype must be one of auto, float32, bfloat16"),
])
def test_serve_refuses_bad_model_options_in_one_line(args, error, tmp_path, monkeypatch, capsys):
    from loraplex.cli.main import main
    from tests.e2e.server import free_port

    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    for name in ("LORAPLEX_DATABASE_URL", "LORAPLEX_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "--device", "cpu", "--port", str(free_port()), "--no-demo", *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("loraplex: error: ") and error in line
