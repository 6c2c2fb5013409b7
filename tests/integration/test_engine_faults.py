"""A fault inside the engine's forward pass, injected into the real engine behind a real server: every
request in flight ends at once with an error its client sees, each leaves a usage row billing what it
generated, the KV cache and the adapter slot come back, and the next requests are served as usual.

The server is create_app over uvicorn in this process (live_app), so the test can make the model's
forward raise; the clients are OpenAI's own, streaming."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.platform.app import create_app
from tests.conftest import make_core
from tests.integration.billing_support import ADMIN, ledger_rows
from tests.integration.live_app import serving

MESSAGES = [{"role": "user", "content": "write a very long story"}]


@dataclass
class Seen:
    """What one streaming client got."""

    tokens: int = 0
    error: Exception | None = None
    ended_at: float | None = None


class Fault:
    """Makes the model's next forward pass raise once `armed` is set."""

    def __init__(self, engine: AsyncEngine, monkeypatch):
        self.armed = threading.Event()
        model = engine.core.runner.model
        real = model.forward

        def forward(*args, **kwargs):
            if self.armed.is_set():
                self.armed.clear()
                raise RuntimeError("injected forward-pass fault")
            return real(*args, **kwargs)

        monkeypatch.setattr(model, "forward", forward)


def admin(base: str, method: str, route: str, **body) -> dict:
    r = httpx.request(method, f"{base}/admin/api{route}", headers=ADMIN, json=body, timeout=30)
    assert r.status_code < 300, r.text
    return r.json() if r.content else {}


def stream_into(client: openai.OpenAI, model: str, seen: Seen) -> None:
    try:
        for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1500, temperature=0,
                                                    stream=True, logprobs=True, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                seen.tokens += len(chunk.choices[0].logprobs.content)
    except openai.APIError as exc:
        seen.error = exc
    seen.ended_at = time.monotonic()


@pytest.fixture
def live(postgres_backend, monkeypatch):
    engine = AsyncEngine(make_core(num_kv_blocks=512, max_loras=1))
    fault = Fault(engine, monkeypatch)
    try:
        with serving(create_app(postgres_backend.settings, engine)) as base:
            yield base, engine, fault
    finally:
        engine.shutdown()


def wait_for(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_a_forward_pass_fault_ends_every_stream_bills_it_and_the_engine_serves_on(live, postgres_backend, peft_dirs):
    base, engine, fault = live
    tenant = f"fault-{time.monotonic_ns() % 10**8}"
    tenant_id = admin(base, "POST", "/tenants", name=tenant)["id"]
    key = admin(base, "POST", f"/tenants/{tenant}/keys")["key"]
    for name, path in zip(("first", "second"), peft_dirs, strict=True):
        admin(base, "POST", f"/tenants/{tenant}/adapters", name=name, base_model="synthetic:tiny", path=str(path))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)

    models = ["synthetic:tiny", "synthetic:tiny", "first"]  # (the adapter holds the only device slot)
    seen = [Seen() for _ in models]
    threads = [threading.Thread(target=stream_into, args=(client, m, s)) for m, s in zip(models, seen, strict=True)]
    for t in threads:
        t.start()
    assert wait_for(lambda: all(s.tokens >= 2 for s in seen), 60), seen  # all three are decoding
    fault.armed.set()
    faulted_at = time.monotonic()
    for t in threads:
        t.join(30)

    for s in seen:  # each stream ended with the platform's error, promptly
        assert isinstance(s.error, openai.APIError) and s.error.body["code"] == "generation_failed", s
        assert s.ended_at - faulted_at < 10
    rows = wait_for(lambda: (r := ledger_rows(postgres_backend.settings, tenant_id)) and len(r) == 3 and r)
    assert rows, "every failed request leaves its usage row"
    assert sorted(r.completion_tokens for r in rows) == sorted(s.tokens for s in seen)  # billed what it generated
    assert {r.status for r in rows} == {"error"} and all(r.prompt_tokens > 0 for r in rows)
    idle = lambda: (s := engine.stats()).kv.blocks_used == 0 and s.requests.running == s.requests.waiting == 0  # noqa: E731
    assert wait_for(idle)  # nothing held, nothing left waiting

    # served as usual after: the base model, and another adapter (it needs the slot the fault freed)
    for model in ("synthetic:tiny", "second"):
        answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 6
    assert wait_for(idle)
