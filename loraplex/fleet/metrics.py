"""The fleet's Prometheus figures, per worker: whether it answers, what this instance sent it, and
what its last health poll said. `serve --worker` hands it to the app's /metrics."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplex.fleet.fleet import EngineFleet


class FleetCollector:
    def __init__(self, fleet: EngineFleet):
        self.fleet = fleet

    def collect(self):
        f = self.fleet
        families = {
            "up": GaugeMetricFamily("loraplex_fleet_worker_up", "1 while the worker answers its health poll",
                                    labels=["worker"]),
            "in_flight": GaugeMetricFamily("loraplex_fleet_worker_in_flight",
                                           "Requests this instance has in flight on the worker", labels=["worker"]),
            "routed": CounterMetricFamily("loraplex_fleet_worker_requests",
                                          "Requests this instance sent to the worker", labels=["worker"]),
            "adapters": GaugeMetricFamily("loraplex_fleet_worker_adapters",
                                          "Adapters this instance registered on the worker", labels=["worker"]),
            "running": GaugeMetricFamily("loraplex_fleet_worker_running", "Requests the worker runs (last poll)",
                                         labels=["worker"]),
            "waiting": GaugeMetricFamily("loraplex_fleet_worker_waiting", "Requests queued on the worker (last poll)",
                                         labels=["worker"]),
        }
        for url in f.workers:
            health = f.health[url]
            families["up"].add_metric([url], 0 if health is None else 1)
            families["in_flight"].add_metric([url], f.load[url])
            families["routed"].add_metric([url], f.routed[url])
            families["adapters"].add_metric([url], len(f.registered(url)))
            if health is not None:
                families["running"].add_metric([url], health.stats.running)
                families["waiting"].add_metric([url], health.stats.waiting)
        yield from families.values()
