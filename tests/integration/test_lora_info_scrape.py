"""/metrics carries the LoRA gauge an inference gateway's endpoint picker reads, behind the admin token; with
LORAPLEX_PICKER_METRICS, /metrics/endpoint-picker serves the picker's gauges without it."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families


def test_metrics_show_the_lora_requests_info_gauge(api):
    assert api.client.get("/metrics").status_code == 401  # the picker's scrape needs the token too
    before = time.time()
    text = api.client.get("/metrics", headers=api.admin).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "loraplex_lora_requests_info"]
    (sample,) = family.samples
    slots = api.backend.engine.inner.stats().adapters.slots
    assert sample.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": str(slots)}
    assert slots > 0 and before <= sample.value <= time.time()


PICKER_GAUGES = {"loraplex_engine_requests_waiting", "loraplex_engine_requests_running",
                 "loraplex_kv_cache_usage_ratio", "loraplex_lora_requests_info"}


def test_the_endpoint_picker_scrape_needs_no_token_only_when_turned_on(backend):
    """LORAPLEX_PICKER_METRICS: the picker's four gauges without the admin token, nothing that names a tenant;
    off (the default), the path answers 404 and /metrics keeps its token."""
    from litestar.testing import TestClient

    with TestClient(backend.app()) as off:
        assert off.get("/metrics/endpoint-picker").status_code == 404
    with TestClient(backend.app(picker_metrics=True)) as on:
        answer = on.get("/metrics/endpoint-picker")
        assert answer.status_code == 200 and on.get("/metrics").status_code == 401
    families = {f.name: f for f in text_string_to_metric_families(answer.text)}
    assert set(families) == PICKER_GAUGES
    labels = {k for f in families.values() for s in f.samples for k in s.labels}
    assert labels == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}  # no tenant, key or model
    assert 0 <= families["loraplex_kv_cache_usage_ratio"].samples[0].value <= 1
