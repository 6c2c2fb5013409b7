"""/metrics carries the LoRA gauge an inference gateway's endpoint picker reads, behind the admin token."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families


def test_metrics_show_the_lora_requests_info_gauge(api):
    assert api.client.get("/metrics").status_code == 401  # the picker's scrape needs the token too
    before = time.time()
    text = api.client.get("/metrics", headers=api.admin).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "loraplex_lora_requests_info"]
    (sample,) = family.samples
    slots = api.backend.engine.inner.stats().adapter_slots
    assert sample.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": str(slots)}
    assert slots > 0 and before <= sample.value <= time.time()
