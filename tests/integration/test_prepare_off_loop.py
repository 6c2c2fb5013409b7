"""Per-request CPU work stays off the event loop, and a request is tokenized once.

Through the real app: a request with n=3 choices is tokenized (chat template and tokenizer) once, on
the engine's preparer threads; `model: "auto"` scores the request off the loop; and a prompt of 9 MB,
or one far past the model's context, answers a 4xx promptly while `/health` keeps answering. The huge
prompts need the platform's body limit and the character bound of the engine's frontend (16 x
max_model_len characters, refused before tokenizing), which land beside this test."""

from __future__ import annotations

import secrets
import threading
import time

import httpx
import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.pool import ModelPool
from loraplex.platform.app import create_app
from tests.conftest import make_core
from tests.integration.billing_support import ADMIN, app_client, new_tenant, platform_of
from tests.integration.live_app import serving
from tests.unit.test_async_engine import counting_tokenizer


@pytest.fixture
def tiny():
    engine = AsyncEngine(make_core())
    yield engine
    engine.shutdown()


def test_n_choices_are_tokenized_once_off_the_loop(postgres_backend, tiny):
    tokenizer = counting_tokenizer(tiny, "synthetic:tiny")
    with app_client(postgres_backend, tiny) as client:
        _, _, key = new_tenant(client, "prep")
        r = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
            "model": "synthetic:tiny", "messages": [{"role": "user", "content": "three stories, please"}],
            "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 7})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3 and r.json()["usage"]["completion_tokens"] == 15
    assert [name for name, _ in tokenizer.calls] == ["chat_template", "encode"]  # once, for all three choices
    assert all(thread.startswith("loraplex-prepare") for _, thread in tokenizer.calls)


def test_auto_scores_the_request_off_the_loop(postgres_backend, monkeypatch):
    name = f"prep-auto-{secrets.token_hex(3)}"
    engine = AsyncEngine(ModelPool(memory_budget=1.0, device="cpu"))
    engine.register_model(name, "synthetic:tiny", config=EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64))
    scored_on: list[str] = []
    try:
        with app_client(postgres_backend, engine) as client:
            scorer = platform_of(client).scorer  # the learned scorer, the app's default
            real_score = scorer.score

            def score(text):
                scored_on.append(threading.current_thread().name)
                return real_score(text)

            monkeypatch.setattr(scorer, "score", score)
            r = client.patch(f"/admin/api/models/{name}", json={"auto_max_complexity": 1.0}, headers=ADMIN)
            assert r.status_code == 200, r.text
            _, _, key = new_tenant(client, "prep")
            r = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
                "model": "auto", "messages": [{"role": "user", "content": "prove that it halts"}],
                "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-loraplex-model"] == name, r.text
            client.patch(f"/admin/api/models/{name}", json={"auto_max_complexity": None}, headers=ADMIN)
    finally:
        engine.shutdown()
    assert scored_on and all(t.startswith("loraplex-auto-score") for t in scored_on)


class HealthProbe:
    """Asks /health every 50 ms on its own thread, and keeps how each ask went (2 s to answer)."""

    def __init__(self, base: str):
        self.base, self.answers, self._stop = base, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:  # (a loop held by one request answers nothing)
            while not self._stop.is_set():
                try:
                    self.answers.append(client.get(f"{self.base}/health").status_code)
                except httpx.HTTPError as exc:
                    self.answers.append(type(exc).__name__)
                time.sleep(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.parametrize("size", [9_000_000, 1_500_000])
def test_a_huge_prompt_is_refused_fast_while_health_answers(postgres_backend, tiny, size):
    app = create_app(postgres_backend.settings, tiny)
    with serving(app) as base:
        tenant = f"prep-{secrets.token_hex(4)}"
        assert httpx.post(f"{base}/admin/api/tenants", json={"name": tenant}, headers=ADMIN).status_code == 201
        key = httpx.post(f"{base}/admin/api/tenants/{tenant}/keys", json={}, headers=ADMIN).json()["key"]
        prompt = "lorem ipsum dolor sit amet " * (size // 27)
        with HealthProbe(base) as probe:
            for path, body in (("/v1/completions", {"prompt": prompt}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})):
                started = time.monotonic()
                r = httpx.post(f"{base}{path}", headers={"authorization": f"Bearer {key}"}, timeout=60,
                               json={"model": "synthetic:tiny", "max_tokens": 4, **body})
                assert 400 <= r.status_code < 500 and "error" in r.json(), r.text[:300]
                assert time.monotonic() - started < 30
            time.sleep(0.2)
        assert probe.answers and all(a == 200 for a in probe.answers), probe.answers
        assert tiny.stats().requests.running == tiny.stats().requests.waiting == 0
