"""/health, /ready, /metrics and /schema."""

from __future__ import annotations

import re
from dataclasses import replace

from litestar.testing import TestClient

from loraplex.platform.app import create_app


def test_health_ready_and_schema(api):
    assert api.client.get("/health").json() == {"status": "ok"}
    ready = api.client.get("/ready")
    assert ready.status_code == 200 and ready.json()["checks"]["models"] == "synthetic:tiny"
    schema = api.client.get("/schema/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/admin/api/tenants"} <= set(schema["paths"])


def _external_refs(html: str) -> list[str]:
    """src= and href= values that name a host (http://, https:// or //host), i.e. anything loaded from elsewhere."""
    return re.findall(r"""(?:src|href)\s*=\s*["']?((?:https?:)?//[^"'\s>]+)""", html, flags=re.IGNORECASE)


def test_the_schema_pages_load_nothing_from_another_host(api):
    """Litestar's Redoc and Swagger pages fetch their scripts (and a favicon) from a CDN: blank offline."""
    for path in ("/schema", "/schema/swagger"):
        page = api.client.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), path
        assert _external_refs(page.text) == [] and "<script" not in page.text.lower(), path
        assert "/v1/chat/completions" in page.text and "/schema/openapi.json" in page.text
        assert "<td class='method'>post</td><td><code>/v1/chat/completions</code>" in page.text
    assert _external_refs("<script src='https://cdn.example/x.js'></script><link href=//cdn.example/y>") == [
        "https://cdn.example/x.js", "//cdn.example/y"]  # the check itself finds such references
    for path in ("/schema/redoc", "/schema/elements", "/schema/rapidoc", "/schema/stoplight"):
        assert api.client.get(path).status_code == 404, path  # the CDN-backed UIs are not served


def test_metrics_cover_latency_tokens_statuses_and_the_engine(api):
    tenant = api.tenant("metrics")
    key = api.key(tenant)
    assert api.chat(key, max_tokens=4).status_code == 200
    api.chat(key, model="nope")
    text = api.client.get("/metrics", headers=api.admin).text
    for name in ("loraplex_time_to_first_token_seconds_bucket", "loraplex_inter_token_latency_seconds_bucket",
                 "loraplex_request_latency_seconds_bucket", "loraplex_requests_in_flight",
                 "loraplex_engine_requests_waiting", "loraplex_kv_cache_usage_ratio", "loraplex_kv_blocks_used",
                 'loraplex_engine_queue_depth{priority="batch"}', "loraplex_prefix_cache_hit_rate",
                 "loraplex_adapter_loads_total", "loraplex_adapter_disk_loads_total",
                 "loraplex_adapter_load_seconds_total", "loraplex_adapter_merges_total",
                 "loraplex_adapter_merged_bytes", "loraplex_adapter_slot_bytes", "loraplex_spec_draft_tokens_total",
                 "loraplex_spec_accepted_tokens_total", "loraplex_model_weight_bytes", "loraplex_kv_cache_bytes",
                 "loraplex_memory_budget_bytes", "loraplex_gpu_memory_utilization", "loraplex_peak_step_bytes"):
        assert name in text, name
    stats = api.backend.engine.inner.stats()  # the KV cache's memory, as the engine reports it
    exported = [float(line.split()[1]) for line in text.splitlines() if line.startswith("loraplex_kv_cache_bytes ")]
    assert stats.memory.kv_cache_bytes > 0 and exported == [stats.memory.kv_cache_bytes]
    assert f'loraplex_tokens_total{{kind="completion",model="synthetic:tiny",tenant="{tenant}"}}' in text
    assert 'loraplex_requests_total{endpoint="/v1/chat/completions",status="404"}' in text


def test_not_ready_until_the_database_is_migrated(backend, tmp_path):
    settings = replace(backend.settings, database_url=f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}",
                       redis_url=None)
    with TestClient(create_app(settings, backend.engine)) as client:
        r = client.get("/ready")
        assert r.status_code == 503 and "loraplex db upgrade" in r.json()["checks"]["startup"]
        assert client.get("/health").status_code == 200


def test_database_down_answers_503_not_a_traceback(backend):
    settings = replace(backend.settings, database_url="postgresql://postgres@127.0.0.1:1/nothing", redis_url=None)
    with TestClient(create_app(settings, backend.engine)) as client:
        assert client.get("/ready").status_code == 503
        r = client.get("/v1/models", headers={"authorization": "Bearer lpx-" + "a" * 43})
        assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable"
