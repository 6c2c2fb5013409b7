"""The real server process on Postgres + Redis, driven with the `openai` client."""

from __future__ import annotations

import secrets
import time

import httpx
import openai
import pytest

from tests.e2e.server import admin_request, serving

ADMIN = "e2e-admin-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("data"), ADMIN, args=("--demo",)) as srv:
        yield srv


def admin(server, method: str, path: str, **kwargs) -> httpx.Response:
    return admin_request(server, ADMIN, method, path, **kwargs)


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def demo(server):
    (key,) = server.demo_keys
    return client(server, key)


def test_models_chat_stream_and_completions(demo):
    ids = {m.id for m in demo.models.list()}
    assert "synthetic:tiny" in ids
    chat = demo.chat.completions.create(model="synthetic:tiny", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=8, temperature=0)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 8
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(demo.chat.completions.create(
        model="synthetic:tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens and chunks[-1].choices == []
    done = demo.completions.create(model="synthetic:tiny", prompt="once upon a time", max_tokens=5)
    assert done.object == "text_completion" and done.usage.completion_tokens <= 5


def test_ignore_eos_generates_max_tokens_past_the_end_of_sequence(demo):
    msgs = [{"role": "user", "content": "go"}]  # sampled with this seed, the reply ends after a few dozen tokens
    natural = demo.chat.completions.create(model="synthetic:tiny", messages=msgs, max_tokens=300, seed=2)
    assert natural.choices[0].finish_reason == "stop" and natural.usage.completion_tokens < 300
    forced = demo.chat.completions.create(model="synthetic:tiny", messages=msgs, max_tokens=300, seed=2,
                                          extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 300
    assert forced.choices[0].message.content.startswith(natural.choices[0].message.content)


def test_wrong_key_is_an_authentication_error(server):
    with pytest.raises(openai.AuthenticationError) as info:
        client(server, "lpx-" + "0" * 43).models.list()
    assert info.value.code == "invalid_api_key"


def test_other_tenants_adapter_is_not_found(server, demo, tmp_path):
    from loraplex.engine.models.loader import load_model, resolve_model
    from tests.lora_factory import make_peft_dir

    path = make_peft_dir(tmp_path / "peft", load_model(resolve_model("synthetic:tiny")).config, rank=8, alpha=16,
                         targets="all", seed=1)
    tenant = f"other-{secrets.token_hex(3)}"
    admin(server, "POST", "/tenants", json={"name": tenant})
    admin(server, "POST", f"/tenants/{tenant}/adapters",
          json={"name": "their-adapter", "base_model": "synthetic:tiny", "path": str(path)})
    owner = client(server, admin(server, "POST", f"/tenants/{tenant}/keys", json={}).json()["key"])
    answer = owner.chat.completions.create(model="their-adapter", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
    assert answer.model == "their-adapter"
    with pytest.raises(openai.NotFoundError) as info:
        demo.chat.completions.create(model="their-adapter", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4)
    assert info.value.code == "model_not_found"


def test_rate_limit_is_a_rate_limit_error_with_headers(server):
    key = admin(server, "POST", "/tenants/demo/keys", json={"rpm_limit": 1}).json()["key"]
    limited = client(server, key)
    limited.completions.create(model="synthetic:tiny", prompt="a", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        limited.completions.create(model="synthetic:tiny", prompt="a", max_tokens=1)
    headers = info.value.response.headers
    assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0" and info.value.code == "rate_limit_exceeded"


def test_prompt_longer_than_the_context_is_a_bad_request(demo):
    with pytest.raises(openai.BadRequestError) as info:
        demo.chat.completions.create(model="synthetic:tiny", messages=[{"role": "user", "content": "x" * 3000}])
    assert info.value.code == "context_length_exceeded"


def _engine_stats(server) -> dict:
    return admin(server, "GET", "/engine/stats").json()


def at_rest(now: dict, baseline: dict) -> bool:
    """Nothing running or waiting, and the KV blocks back at the baseline."""
    return (now["requests"]["running"], now["requests"]["waiting"], now["kv"]["blocks_used"]) == (
        0, 0, baseline["kv"]["blocks_used"])


def _disconnects(server) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text.splitlines():
        if line.startswith("loraplex_client_disconnects_total "):
            return float(line.split()[1])
    return 0.0


def test_client_disconnect_mid_stream_aborts_the_engine_request(server, demo):
    baseline, disconnects = _engine_stats(server), _disconnects(server)
    assert baseline["requests"]["running"] == baseline["requests"]["waiting"] == 0
    # ignore_eos: left alone, the reply ends after a few dozen tokens, in about 0.1 s, which a loaded
    # machine can finish sending before the server sees the client leave
    stream = demo.chat.completions.create(model="synthetic:tiny", messages=[{"role": "user", "content": "go"}],
                                          max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    for received, _ in enumerate(stream, 1):
        if received == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = _engine_stats(server)
        if at_rest(now, baseline):
            break
        time.sleep(0.05)
    assert at_rest(now, baseline), now
    assert _disconnects(server) == disconnects + 1  # ended by the disconnect, not by finishing
