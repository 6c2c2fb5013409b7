"""Prometheus metrics, in a registry per app (several apps can live in one process: tests, bench).

- Engine figures (running, waiting, KV blocks) are read from `engine.stats()` at scrape time, and the ledger's and
  budget counters' figures (queue depth, spool size, rebuilds) from those objects.
- Labels name tenants, models, endpoints and priority classes, never a key (no prefix, no id), and adapters by engine
  id (`adapter-<row>-<time>`), except loraplex_adapter_tokens_total, which names the tenant and its registered
  adapter (bounded: AdapterTokens).
- The operator reads them behind the admin token (ops.py).
- The gauges a Gateway API inference extension endpoint picker reads are in docs/scale-out.md ("Behind a Kubernetes
  inference gateway").
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplex.engine.api import PRIORITY_CLASSES, EngineClient, EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_COMPLEXITY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LORA_INFO_MAX_ADAPTERS = 64  # adapter ids per label of loraplex_lora_requests_info
KNOWN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics",
                   "/metrics/endpoint-picker")


def endpoint_label(path: str) -> str:
    """A bounded label: known endpoints by path, the admin API as one, the rest as "other"."""
    if path in KNOWN_ENDPOINTS:
        return path
    return "/admin/api" if path.startswith("/admin/api/") else "other"


def adapter_list_label(adapter_ids: tuple[str, ...]) -> str:
    """Adapter ids comma-separated, as vLLM's LoRA gauge lists them, the first LORA_INFO_MAX_ADAPTERS
    only: a tenant can register, and queue requests for, any number of adapters."""
    return ",".join(adapter_ids[:LORA_INFO_MAX_ADAPTERS])


def lora_requests_info(stats: EngineStats) -> GaugeMetricFamily:
    """vLLM's `lora_requests_info` shape: the adapters running and waiting and the slot count as
    labels, the sampling time as the value (an endpoint picker reads the newest sample's labels)."""
    metric = GaugeMetricFamily("loraplex_lora_requests_info", "Adapters of the requests running and waiting "
                               "(engine ids), and the adapter slots; the value is when it was sampled",
                               labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    metric.add_metric([adapter_list_label(stats.adapters.running), adapter_list_label(stats.adapters.waiting),
                       str(stats.adapters.slots)], time.time())
    return metric


def picker_metrics(stats: EngineStats) -> bytes:
    """The exposition of the gauges an inference gateway's endpoint picker reads, and nothing else: no series
    here names a tenant (ops.py serves it without the admin token when LORAPLEX_PICKER_METRICS is on)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_PickerCollector(stats))
    return generate_latest(registry)


class _PickerCollector:
    def __init__(self, stats: EngineStats):
        self._stats = stats

    def collect(self):
        yield from picker_families(self._stats)


def picker_families(s: EngineStats):
    """Queued and running requests, KV use (0..1) and the LoRA info gauge: what an endpoint picker reads."""
    yield GaugeMetricFamily("loraplex_engine_requests_running", "Requests the engine is running",
                            value=s.requests.running)
    yield GaugeMetricFamily("loraplex_engine_requests_waiting", "Requests queued in the engine (all classes)",
                            value=s.requests.waiting)
    yield GaugeMetricFamily("loraplex_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                            value=s.kv.blocks_used / s.kv.blocks_total if s.kv.blocks_total else 0.0)
    yield lora_requests_info(s)


class EngineCollector:
    def __init__(self, engine: EngineClient):
        self._engine = engine

    def collect(self):
        s = self._engine.stats()
        yield from picker_families(s)
        yield _by_class(GaugeMetricFamily, "loraplex_engine_queue_depth", "Requests waiting in the engine by class",
                        s.requests.waiting_by_class)
        yield _by_class(GaugeMetricFamily, "loraplex_engine_running_by_class", "Requests running by class",
                        s.requests.running_by_class)
        yield _by_class(CounterMetricFamily, "loraplex_engine_preemptions", "Requests preempted, by class",
                        s.requests.preemptions_by_class)
        yield GaugeMetricFamily("loraplex_engine_swapped_requests", "Requests swapped out to CPU memory",
                                value=s.requests.swapped_requests)
        yield GaugeMetricFamily("loraplex_kv_blocks_used", "KV cache blocks in use", value=s.kv.blocks_used)
        yield GaugeMetricFamily("loraplex_kv_blocks_total", "KV cache blocks in the pool", value=s.kv.blocks_total)
        yield GaugeMetricFamily("loraplex_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache",
                                value=s.kv.prefix_cache_hit_rate)
        yield CounterMetricFamily("loraplex_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=s.kv.prefix_hit_tokens)
        yield GaugeMetricFamily("loraplex_adapters_loaded", "Adapters resident in device slots",
                                value=s.adapters.loaded)
        yield CounterMetricFamily("loraplex_adapter_loads", "Adapter loads into device slots", value=s.adapters.loads)
        yield CounterMetricFamily("loraplex_adapter_disk_loads", "Adapter loads into device slots that read the "
                                  "adapter from disk (the rest came from the CPU tier)", value=s.adapters.disk_loads)
        yield CounterMetricFamily("loraplex_adapter_load_seconds", "Wall time of adapter loads into device slots "
                                  "(over loraplex_adapter_loads_total: the mean load time)",
                                  value=s.adapters.load_seconds)
        yield CounterMetricFamily("loraplex_adapter_evictions", "Adapter evictions from device slots",
                                  value=s.adapters.evictions)
        yield CounterMetricFamily("loraplex_adapter_merges", "Adapters merged into a copy of the weights for "
                                  "decode steps wholly on them", value=s.adapters.merges)
        yield GaugeMetricFamily("loraplex_adapter_merged_bytes", "Memory of the merged adapter weight copies",
                                value=s.adapters.merged_bytes)
        yield GaugeMetricFamily("loraplex_model_weight_bytes", "Memory of the resident base models' weights: as "
                                "loaded, plus the CPU kernels' packed copies (at --weight-dtype)",
                                value=s.models.weight_bytes)
        yield GaugeMetricFamily("loraplex_adapter_slot_bytes", "Memory of the adapter slot buffers (at the slots' "
                                "dtype) and the folded adapter copies", value=s.adapters.slot_bytes)
        yield GaugeMetricFamily("loraplex_kv_cache_bytes", "Memory of the KV caches", value=s.memory.kv_cache_bytes)
        yield GaugeMetricFamily("loraplex_memory_budget_bytes", "Device memory for weights, KV cache and adapter "
                                "slots that --gpu-memory-utilization left after other memory and a maximum-size "
                                "step (CUDA, measured at start; 0 where not measured)", value=s.memory.budget_bytes)
        yield GaugeMetricFamily("loraplex_gpu_memory_utilization", "Fraction of the device's memory the engine "
                                "sized itself to (0 where not measured)", value=s.memory.gpu_memory_utilization)
        yield GaugeMetricFamily("loraplex_peak_step_bytes", "Activation memory of a maximum-size step, profiled at "
                                "start (CUDA; 0 where not measured)", value=s.memory.peak_step_bytes)
        yield CounterMetricFamily("loraplex_engine_generated_tokens", "Tokens the engine generated",
                                  value=s.requests.generated_tokens)
        yield CounterMetricFamily("loraplex_engine_steps", "Engine steps run", value=s.requests.num_steps)
        yield CounterMetricFamily("loraplex_spec_draft_tokens", "Speculative decoding: draft tokens verified",
                                  value=s.speculation.draft_tokens)
        yield CounterMetricFamily("loraplex_spec_accepted_tokens", "Speculative decoding: draft tokens the model "
                                  "agreed with (over the drafts: the acceptance rate)",
                                  value=s.speculation.accepted_tokens)
        yield from _replicas(self._engine.replicas())


_REPLICA_FAMILIES = (  # (field of ReplicaInfo, family, name, help); none with an engine in this process
    ("running", GaugeMetricFamily, "loraplex_replica_running", "Requests the engine replica runs (its last poll)"),
    ("waiting", GaugeMetricFamily, "loraplex_replica_waiting", "Requests queued on the replica (its last poll)"),
    ("requests", CounterMetricFamily, "loraplex_replica_requests", "Generations the replica started, from every "
                                                                   "gateway"),
)


def _replicas(replicas: list):
    """Per engine replica (Ray Serve) gauges, labelled by replica id, and its adapter count."""
    if not replicas:
        return
    for field, family, name, documentation in _REPLICA_FAMILIES:
        metric = family(name, documentation, labels=["replica"])
        for r in replicas:
            metric.add_metric([r.replica], float(getattr(r, field)))
        yield metric
    adapters = GaugeMetricFamily("loraplex_replica_adapters", "Adapters registered on the replica", labels=["replica"])
    for r in replicas:
        adapters.add_metric([r.replica], float(len(r.adapters)))
    yield adapters


class BillingCollector:
    def __init__(self, ledger, quota):
        self._ledger, self._quota = ledger, quota

    def collect(self):
        ledger, spool = self._ledger, self._ledger.spool
        yield GaugeMetricFamily("loraplex_ledger_queue_depth", "Usage events waiting for the ledger writer",
                                value=ledger.queue_depth)
        yield GaugeMetricFamily("loraplex_ledger_spool_events", "Usage events in the local spool (database down)",
                                value=spool.events)
        yield GaugeMetricFamily("loraplex_ledger_spool_bytes", "Size of the local spool", value=spool.bytes)
        yield GaugeMetricFamily("loraplex_ledger_down", "1 while the ledger database cannot be written",
                                value=int(ledger.down))
        yield CounterMetricFamily("loraplex_ledger_rows_written", "Usage rows written to the ledger",
                                  value=ledger.rows_written)
        yield CounterMetricFamily("loraplex_ledger_write_failures", "Ledger batches that could not be written",
                                  value=ledger.write_failures)
        yield CounterMetricFamily("loraplex_ledger_events_spooled", "Usage events written to the spool",
                                  value=ledger.events_spooled)
        yield CounterMetricFamily("loraplex_ledger_events_quarantined",
                                  "Usage events the database refused for their content, set aside in the "
                                  "spool's quarantine file", value=ledger.events_quarantined)
        yield CounterMetricFamily("loraplex_ledger_spool_failures", "Spool writes that failed (disk full, I/O error)",
                                  value=ledger.spool_failures)
        yield CounterMetricFamily("loraplex_ledger_events_dropped",
                                  "Usage events lost: the database and the spool both unwritable, memory full",
                                  value=ledger.events_dropped)
        yield GaugeMetricFamily("loraplex_ledger_spool_down", "1 while the local spool cannot be written",
                                value=int(ledger.spool_down))
        yield CounterMetricFamily("loraplex_budget_counter_rebuilds",
                                  "Tenants' budget counters rebuilt from the ledger", value=self._quota.rebuilds)
        yield GaugeMetricFamily("loraplex_budget_unconfirmed_charges",
                                "Requests whose usage the ledger does not hold yet (in flight or queued)",
                                value=len(self._quota.tail))


def _by_class(family, name: str, documentation: str, values: dict[str, int]):
    metric = family(name, documentation, labels=["priority"])
    for cls in PRIORITY_CLASSES:
        metric.add_metric([cls], values.get(cls, 0))
    return metric


class Family:
    """A labelled metric whose child per label values is looked up once: prometheus_client's
    labels() checks the values and takes a lock on every call, and the request path calls it
    several times per request (and per token for the inter-token latency)."""

    def __init__(self, metric):
        self.metric = metric
        self._children: dict[tuple, object] = {}

    def labels(self, *values):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class AdapterTokens:
    """Prompt and completion tokens by tenant and adapter name. Only a registered adapter a request
    resolved to is counted (an unknown name is refused before it runs, so it never makes a label), and
    past `max_adapters` distinct adapters the rest count under the adapter label OTHER."""

    OTHER = "(other)"  # no adapter can be named so (tenancy/common.py's NAME)

    def __init__(self, counter: Counter, max_adapters: int):
        self.family, self.max_adapters = Family(counter), max_adapters
        self._named: set[tuple[str, str]] = set()  # the (tenant, adapter) pairs that have a label of their own

    def add(self, tenant: str, adapter: str, prompt_tokens: int, completion_tokens: int) -> None:
        if (tenant, adapter) not in self._named:
            if len(self._named) < self.max_adapters:
                self._named.add((tenant, adapter))
            else:
                adapter = self.OTHER
        self.family.labels(tenant, adapter, "prompt").inc(prompt_tokens)
        self.family.labels(tenant, adapter, "completion").inc(completion_tokens)


ADAPTER_TOKENS_MAX_ADAPTERS = 1000  # distinct (tenant, adapter) label pairs of loraplex_adapter_tokens_total


class Metrics:
    def __init__(self, engine: EngineClient, max_adapter_labels: int = ADAPTER_TOKENS_MAX_ADAPTERS):
        r = self.registry = CollectorRegistry()
        self.requests = Family(Counter("loraplex_requests", "HTTP requests by endpoint and status code",
                                       ["endpoint", "status"], registry=r))
        self.ttft = Family(Histogram("loraplex_time_to_first_token_seconds", "Arrival to first generated token",
                                     ["model"], buckets=_LATENCY_BUCKETS, registry=r))
        self.itl = Family(Histogram("loraplex_inter_token_latency_seconds", "Time between generated tokens",
                                    ["model"], buckets=_ITL_BUCKETS, registry=r))
        self.latency = Family(Histogram("loraplex_request_latency_seconds",
                                        "Arrival to the last byte of a generation", ["endpoint", "status"],
                                        buckets=_LATENCY_BUCKETS, registry=r))
        self.tokens = Family(Counter("loraplex_tokens",
                                     "Tokens by tenant, base model and kind (prompt, cached, completion)",
                                     ["tenant", "model", "kind"], registry=r))
        self.adapter_tokens = AdapterTokens(Counter(
            "loraplex_adapter_tokens", "Tokens of requests for a tenant's registered adapter, by kind (prompt, "
            "completion); past the cap of distinct adapters, under adapter=\"(other)\"", ["tenant", "adapter", "kind"],
            registry=r), max_adapter_labels)
        self.rate_limited = Counter("loraplex_rate_limit_rejections", "Requests refused by a rate limit",
                                    ["limit"], registry=r)
        self.limiter_errors = Counter("loraplex_rate_limiter_errors", "Rate-limit store unreachable (Redis down)",
                                      ["outcome"], registry=r)
        self.in_flight = Family(Gauge("loraplex_requests_in_flight",
                                      "Generations in flight (queue depth) by priority class", ["priority"],
                                      registry=r))
        for cls in PRIORITY_CLASSES:
            self.in_flight.labels(cls)
        self.disconnects = Counter("loraplex_client_disconnects", "Streams the client left before the end",
                                   registry=r)
        self.timeouts = Counter("loraplex_request_timeouts", "Generations aborted after the request timeout",
                                registry=r)
        self.budget_rejections = Counter("loraplex_budget_rejections",
                                         "Requests refused by a token budget (429 insufficient_quota)", ["scope"],
                                         registry=r)
        self.soft_limit_reached = Family(Gauge(
            "loraplex_budget_soft_limit_reached", "1 while a budget's soft limit is reached in its current period "
            "(a tenant's key budgets of one period: while the last settled one's is)", ["tenant", "budget"],
            registry=r))
        self.soft_limit_alerts = Family(Counter(
            "loraplex_budget_soft_limit_alerts", "Requests that took a budget past its soft limit",
            ["tenant", "budget"], registry=r))
        self.auto_routed = Family(Counter("loraplex_auto_routed_requests", "Requests for `auto`, by model chosen",
                                          ["model"], registry=r))
        self.auto_complexity = Histogram("loraplex_auto_request_complexity", "Complexity scores of `auto` requests",
                                         buckets=_COMPLEXITY_BUCKETS, registry=r)
        self.structured = Family(Counter(
            "loraplex_structured_requests", "Admitted requests whose output guided decoding holds, by kind "
            "(json_object, json_schema, tool_call)", ["kind"], registry=r))
        r.register(EngineCollector(engine))

    def watch_billing(self, ledger, quota) -> None:
        self.registry.register(BillingCollector(ledger, quota))

    def render(self) -> bytes:
        return generate_latest(self.registry)
