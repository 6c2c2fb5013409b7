"""Starts or joins a Ray cluster and runs the engine replicas' Serve application (`loraplex serve --ray`).

- `auto` starts a local Ray cluster in this process; an address (`host:6379`, the head's GCS) joins one from a
  node of that cluster (`ray start --address` first). Not `ray://`: Ray Client has no streaming handles.
- Serve's own HTTP proxy stays off (the gateway is the ingress; the proxy would take port 8000).
- A fixed replica count, or Serve's autoscaling between a minimum and a maximum on ongoing requests.
- A gateway given no replica count joins the application another gateway deployed, if one runs: several
  gateway instances share one deployment. One given counts deploys again, and Serve replaces the running
  replicas (it versions a deployment run from Python itself; Ray 2.60 took the `version` option away).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.engine.api import EngineClient
from loraplex.ray_serve.client import RayEngineClient

log = logging.getLogger("loraplex.ray_serve")

APP_NAME = "loraplex"
DEPLOYMENT_NAME = "EngineReplica"


@dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas, and what each holds: a fixed count, or autoscaling between min and max."""

    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 256  # per replica: the engine batches them; Serve queues the rest
    target_ongoing_requests: int = 64  # autoscaling adds a replica past this many in flight per replica
    upscale_delay_s: float = 30.0  # ... once that has lasted this long (Serve's default)
    affinity: bool = True  # route with AffinityRouter (router.py); False: Serve's default router (benchmarks)
    tagged: bool = True  # requests carry their multiplexed id (client.affinity_key); False: none (benchmarks)

    def __post_init__(self) -> None:
        if self.replicas is not None and (self.min_replicas is not None or self.max_replicas is not None):
            raise ValueError("--replicas is a fixed count: give it, or --min-replicas/--max-replicas, not both")
        for name in ("replicas", "min_replicas", "max_replicas"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= 1024:
                raise ValueError(f"--{name.replace('_', '-')} must be in 1..1024, got {value}")
        if (self.min_replicas or 1) > (self.max_replicas or self.min_replicas or 1):
            raise ValueError(f"--min-replicas {self.min_replicas} is above --max-replicas {self.max_replicas}")

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.replicas, self.min_replicas, self.max_replicas))

    def deployment_options(self) -> dict:
        """serve.deployment's options for this plan."""
        from ray.serve.config import RequestRouterConfig

        options: dict = {"name": DEPLOYMENT_NAME, "max_ongoing_requests": self.max_ongoing_requests,
                         "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}}
        if self.affinity:
            options["request_router_config"] = RequestRouterConfig(
                request_router_class="loraplex.ray_serve.router:AffinityRouter")
        if self.min_replicas is not None or self.max_replicas is not None:
            low = self.min_replicas or 1
            options["autoscaling_config"] = {"min_replicas": low, "max_replicas": self.max_replicas or low,
                                             "target_ongoing_requests": self.target_ongoing_requests,
                                             "upscale_delay_s": self.upscale_delay_s}
        else:
            options["num_replicas"] = self.replicas or 1
        return options


def connect_cluster(address: str) -> None:
    """`auto`: a local Ray cluster started here; else the cluster at `address`."""
    import ray

    if ray.is_initialized():
        return
    local = {"include_dashboard": False} if address == "auto" else {}
    ray.init(address=None if address == "auto" else address, logging_level=logging.WARNING,
             log_to_driver=False, configure_logging=False, **local)


def deploy(address: str, plan: ReplicaPlan, engine_factory: Callable[[], EngineClient]) -> RayEngineClient:
    """The client of the engine replicas' application on the cluster: deployed now (replacing it if it runs),
    or joined when another gateway deployed it and this one gives no replica count."""
    from ray import serve

    from loraplex.ray_serve.replica import EngineReplica

    connect_cluster(address)
    serve.start(proxy_location="Disabled")
    if not plan.given and _running(serve):
        log.info("joining the running Serve application %r", APP_NAME)
        handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME)
    else:
        deployment = serve.deployment(EngineReplica, **plan.deployment_options())
        handle = serve.run(deployment.bind(engine_factory), name=APP_NAME, route_prefix=None)
    client = RayEngineClient(handle, tagged=plan.tagged)
    client.connect()
    return client


def _running(serve) -> bool:
    return APP_NAME in serve.status().applications
