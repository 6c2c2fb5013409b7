"""Two gateways over one Ray Serve deployment of two engine replicas (a real local Ray cluster, `ray.init(num_cpus=2)`),
on Postgres + Redis: the budget flood stays exact across gateways and replicas (the ledger holds exactly the answered
requests, never over the budget, and both gateways' counters agree with it); a request makes one call to a replica
(its generation: the gateway prepares it, refusing what an engine would, word for word, with no call); and Serve's
autoscaling adds a replica under load."""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import ray
from ray import serve

from loraplex.cli.engine_args import ENGINE_OPTIONS, build_engine
from loraplex.engine.api import EngineError, GenerateRequest, SamplingParams
from loraplex.ray_serve.client import RayEngineClient
from loraplex.ray_serve.deploy import APP_NAME, DEPLOYMENT_NAME, ReplicaPlan, deploy
from tests.conftest import _loaded, one_ray_cluster
from tests.integration.billing_support import SLOW_OK, app_client, complete, flood_two_instances, new_tenant
from tests.integration.conftest import Backend
from tests.lora_factory import make_peft_dir

MODEL = "synthetic:tiny"


def engine_factory(threads: int | None = 1):
    """What `serve --ray --model synthetic:tiny --device cpu --kv-cache-mb 16 --threads 1` gives each replica."""
    options = {**dict.fromkeys(ENGINE_OPTIONS), "model": [MODEL], "device": "cpu", "kv_cache_mb": 16,
               "threads": threads}
    return functools.partial(build_engine, argparse.Namespace(**options))


@pytest.fixture(scope="module")
def cluster():
    with one_ray_cluster():
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
    # Serve's default router: affinity keeps the flood's one tenant on one replica (30 short requests stay under its
    # load bound), and the budgets are to hold across replicas
    first = deploy("auto", ReplicaPlan(replicas=2, num_cpus=0.5, affinity=False), engine_factory())
    assert len(first.replicas()) == 2
    backend = Backend("postgres-ray", postgres_backend.settings, first)
    with app_client(backend, **SLOW_OK) as a, app_client(backend, engine=gateway_client(), **SLOW_OK) as b:
        flood_two_instances(a, b, requests=120, fit=30)
    served = [r.requests for r in gateway_client().replicas()]
    assert len(served) == 2 and min(served) > 0  # both replicas served the flood


class CountingHandle:
    """The deployment handle, counting by method the calls it sends to replicas (each one a real call)."""

    def __init__(self, handle, calls: collections.Counter):
        self._handle, self.calls = handle, calls

    def options(self, **options) -> CountingHandle:
        return CountingHandle(self._handle.options(**options), self.calls)

    def broadcast(self, method: str, *args):
        self.calls[f"broadcast:{method}"] += 1
        return self._handle.broadcast(method, *args)

    def __getattr__(self, method: str):
        def remote(*args, **kwargs):
            self.calls[method] += 1
            return getattr(self._handle, method).remote(*args, **kwargs)
        return SimpleNamespace(remote=remote)


async def _refusal(engine, request: GenerateRequest) -> tuple:
    with pytest.raises(EngineError) as info:
        await engine.prepare(request)
    return type(info.value), info.value.message, info.value.param


async def _served(engine, request: GenerateRequest) -> tuple:
    prepared = await engine.prepare(request)
    events = [event async for event in engine.generate(prepared)]
    return prepared.prompt_token_ids, events[-1].finish_reason, "".join(e.text for e in events)


def test_a_request_makes_one_call_to_a_replica_and_a_refused_one_none(cluster, tmp_path):
    """The gateway prepares requests as the replicas' engines do (the same tokens, the same errors as an engine in
    this process with the same options): a generation is a request's only call to a replica, a refusal makes none."""
    deploy("auto", ReplicaPlan(num_cpus=0.5), engine_factory())  # (joins the running deployment, if there is one)
    calls: collections.Counter = collections.Counter()
    client = RayEngineClient(CountingHandle(serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME), calls))
    client.connect()
    local = engine_factory(threads=None)()
    path = make_peft_dir(tmp_path / "tuned", _loaded(MODEL).config, rank=8, alpha=16, targets="all", seed=3)
    for engine in (client, local):
        engine.add_adapter("tuned", str(path), MODEL)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    served = [GenerateRequest("plain", MODEL, prompt="hello ray", sampling=greedy),
              GenerateRequest("chat", MODEL, messages=({"role": "user", "content": "hi"},), sampling=greedy,
                              adapter="tuned"),
              GenerateRequest("schema", MODEL, prompt="{", sampling=SamplingParams(
                  max_tokens=8, temperature=0.0, json_schema='{"type": "object"}'))]
    refused = [GenerateRequest("long", MODEL, prompt="a " * 1500, sampling=greedy),  # 3000 tokens: past 2048
               GenerateRequest("huge", MODEL, prompt="a" * 10**6, sampling=greedy),  # refused untokenized
               GenerateRequest("ghost", MODEL, prompt="hi", sampling=greedy, adapter="ghost"),
               GenerateRequest("model", "synthetic:none", prompt="hi", sampling=greedy),
               GenerateRequest("badschema", MODEL, prompt="hi", sampling=SamplingParams(json_schema="{nope")),
               GenerateRequest("hot", MODEL, prompt="hi", sampling=SamplingParams(temperature=-1.0))]

    async def run() -> None:
        calls.clear()
        for request in refused:
            assert await _refusal(client, request) == await _refusal(local, request), request.request_id
        assert calls == {}  # no replica was asked
        for request in served:
            # greedy on the same weights: the same tokens in, the same text out
            assert await _served(client, request) == await _served(local, request), request.request_id
        assert calls == {"generate": len(served)}
        await client.close()

    try:
        asyncio.run(run())
    finally:
        local.shutdown()


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
