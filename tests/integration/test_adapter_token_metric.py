"""loraplex_adapter_tokens_total: prompt and completion tokens by tenant and registered adapter, read
from the real app served over HTTP; a name that is no registered adapter never makes a label, and the
label set has a cap."""

from __future__ import annotations

import re
import secrets

import httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest

from loraplex.platform.metrics import AdapterTokens
from tests.integration.conftest import ADMIN_TOKEN
from tests.integration.live_app import serving

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
SERIES = re.compile(r'^loraplex_adapter_tokens_total\{adapter="([^"]*)",kind="(\w+)",tenant="([^"]*)"\} (\S+)$')


def _series(text: str) -> dict[tuple[str, str, str], float]:
    """{(tenant, adapter, kind): value} of the counter in an exposition."""
    found = {}
    for line in text.splitlines():
        m = SERIES.match(line)
        if m:
            adapter, kind, tenant, value = m.groups()
            found[(tenant, adapter, kind)] = float(value)
    return found


def test_tokens_are_counted_by_registered_adapter_only(postgres_backend, peft_dirs):
    with serving(postgres_backend.app()) as base, httpx.Client(base_url=base, timeout=60) as http:
        tenant = f"adapter-metric-{secrets.token_hex(4)}"
        assert http.post("/admin/api/tenants", json={"name": tenant}, headers=ADMIN).status_code == 201
        for name, path in (("helper", peft_dirs[0]), ("unused", peft_dirs[1])):
            r = http.post(f"/admin/api/tenants/{tenant}/adapters", headers=ADMIN,
                          json={"name": name, "base_model": "synthetic:tiny", "path": str(path)})
            assert r.status_code == 201, r.text
        key = http.post(f"/admin/api/tenants/{tenant}/keys", json={}, headers=ADMIN).json()["key"]
        auth = {"authorization": f"Bearer {key}"}

        def chat(model: str) -> httpx.Response:
            return http.post("/v1/chat/completions", headers=auth, json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0})

        usages = [chat(model).json()["usage"] for model in ("helper", "synthetic:tiny:helper")]
        assert chat("synthetic:tiny").status_code == 200  # the base model: no adapter label
        for hostile in ("not-registered", "x" * 5000, "helper\n", '"}evil{"'):
            assert chat(hostile).status_code in (400, 404)
        text = http.get("/metrics", headers=ADMIN).text

    series = {k: v for k, v in _series(text).items() if k[0] == tenant}
    assert series == {(tenant, "helper", "prompt"): sum(u["prompt_tokens"] for u in usages),
                      (tenant, "helper", "completion"): sum(u["completion_tokens"] for u in usages)}
    assert "not-registered" not in text and "evil" not in text and "x" * 100 not in text


def test_past_the_cap_adapters_count_under_other():
    registry = CollectorRegistry()
    tokens = AdapterTokens(Counter("loraplex_adapter_tokens", "t", ["tenant", "adapter", "kind"], registry=registry),
                           max_adapters=2)
    for i in range(50):
        tokens.add("acme", f"a{i}", 10, 1)
    tokens.add("acme", "a0", 5, 5)  # one of the first two keeps its own label
    series = _series(generate_latest(registry).decode())
    assert {adapter for _, adapter, _ in series} == {"a0", "a1", AdapterTokens.OTHER}
    assert series[("acme", "a0", "prompt")] == 15 and series[("acme", AdapterTokens.OTHER, "prompt")] == 480
    assert series[("acme", AdapterTokens.OTHER, "completion")] == 48
