"""Two gateways over one Ray Serve deployment of two engine replicas (a real local Ray cluster, `ray.init(num_cpus=2)`),
on Postgres + Redis: the budget flood stays exact across gateways and replicas (the ledger holds exactly the answered
requests, never over the budget, and both gateways' counters agree with it); and Serve's autoscaling adds a replica
under load."""

from __future__ import annotations

import argparse
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from ray import serve

from loraplex.cli.engine_args import ENGINE_OPTIONS, build_engine
from loraplex.ray_serve.client import RayEngineClient
from loraplex.ray_serve.deploy import APP_NAME, DEPLOYMENT_NAME, ReplicaPlan, deploy
from tests.integration.billing_support import SLOW_OK, app_client, complete, flood_two_instances, new_tenant
from tests.integration.conftest import Backend

MODEL = "synthetic:tiny"


def engine_factory():
    """What `serve --ray --model synthetic:tiny --device cpu --kv-cache-mb 16 --threads 1` gives each replica."""
    options = {**dict.fromkeys(ENGINE_OPTIONS), "model": [MODEL], "device": "cpu", "kv_cache_mb": 16, "threads": 1}
    return functools.partial(build_engine, argparse.Namespace(**options))


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def gateway_client() -> RayEngineClient:
    """One more gateway's client of the running deployment (as `serve --ray ADDRESS` without counts joins it)."""
    client = RayEngineClient(serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME))
    client.connect()
    return client


def test_two_gateways_over_two_replicas_keep_the_budget_exact(cluster, postgres_backend):
    first = deploy("auto", ReplicaPlan(replicas=2, num_cpus=0.5), engine_factory())
    assert len(first.replicas()) == 2
    backend = Backend("postgres-ray", postgres_backend.settings, first)
    with app_client(backend, **SLOW_OK) as a, app_client(backend, engine=gateway_client(), **SLOW_OK) as b:
        flood_two_instances(a, b, requests=120, fit=30)
    served = [r.requests for r in gateway_client().replicas()]
    assert len(served) == 2 and min(served) > 0  # both replicas served the flood


def test_autoscaling_adds_a_replica_under_load(cluster, postgres_backend):
    serve.delete(APP_NAME)  # (from nothing: a fixed deployment's replicas would linger while it scales down)
    plan = ReplicaPlan(min_replicas=1, max_replicas=2, num_cpus=0.5, target_ongoing_requests=2, upscale_delay_s=1)
    client = deploy("auto", plan, engine_factory())
    assert len(client.replicas()) == 1
    backend = Backend("postgres-ray", postgres_backend.settings, client)
    with app_client(backend, **SLOW_OK) as gateway:
        _, _, key = new_tenant(gateway, "load")
        deadline, count = time.monotonic() + 120, 1
        with ThreadPoolExecutor(max_workers=8) as pool:
            while count < 2 and time.monotonic() < deadline:  # 8 long requests in flight: 4x the target
                answers = list(pool.map(lambda _: complete(gateway, key, max_tokens=120), range(8)))
                assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
                count = len(gateway_client().replicas())
    assert count == 2
