"""The Ray Serve deployment's pure parts: the replica plan from the CLI's counts, and the affinity key and rendezvous
ranking that keep an adapter's (or a tenant's) requests on few replicas. The deployment itself runs on a real local
Ray cluster in tests/e2e/test_serve_ray.py."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.ray_serve.client import affinity_key
from loraplex.ray_serve.deploy import ReplicaPlan
from loraplex.ray_serve.router import rendezvous_score


def test_a_fixed_count_or_an_autoscaling_range():
    fixed = ReplicaPlan(replicas=3, num_gpus=1.0).deployment_options()
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert fixed["max_ongoing_requests"] >= 64  # the engine batches them: Serve's default of 5 would starve it
    scaled = ReplicaPlan(min_replicas=1, max_replicas=4).deployment_options()["autoscaling_config"]
    assert scaled["min_replicas"] == 1 and scaled["max_replicas"] == 4 and scaled["target_ongoing_requests"] > 0
    assert ReplicaPlan().deployment_options()["num_replicas"] == 1 and not ReplicaPlan().given


@pytest.mark.parametrize(("counts", "message"), [
    ({"replicas": 2, "min_replicas": 1}, "--replicas is a fixed count"),
    ({"min_replicas": 5, "max_replicas": 2}, "--min-replicas 5 is above --max-replicas 2"),
    ({"replicas": 0}, "--replicas must be in 1..1024"),
    ({"max_replicas": 10**9}, "--max-replicas must be in 1..1024"),
])
def test_wrong_counts_are_refused_in_one_line(counts, message):
    with pytest.raises(ValueError, match=message):
        ReplicaPlan(**counts)


def _request(adapter: str | None = None, salt: str | None = None) -> GenerateRequest:
    return GenerateRequest("r", "base", prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=1),
                           adapter=adapter, cache_salt=salt)


def test_affinity_keys_name_the_adapter_or_a_digest_of_the_tenants_salt():
    assert affinity_key(_request(adapter="adapter-7-1")) == "adapter:adapter-7-1"
    tenant_a, tenant_b = affinity_key(_request(salt="salt-a")), affinity_key(_request(salt="salt-b"))
    assert tenant_a.startswith("base:base:") and tenant_a != tenant_b and "salt-a" not in tenant_a
    assert affinity_key(_request(salt="salt-a")) == tenant_a


def test_rendezvous_ranking_is_stable_and_spreads_keys():
    replicas = [f"replica{i}" for i in range(4)]
    first = {key: max(replicas, key=lambda r: rendezvous_score(key, r)) for key in (f"adapter:{i}" for i in range(200))}
    again = {key: max(replicas, key=lambda r: rendezvous_score(key, r)) for key in first}
    assert again == first  # every gateway agrees
    counts = [list(first.values()).count(r) for r in replicas]
    assert min(counts) > 25  # about 50 each
    # a replica leaving moves only its own keys
    rest = replicas[1:]
    moved = [k for k, r in first.items() if r != "replica0" and max(rest, key=lambda x: rendezvous_score(k, x)) != r]
    assert moved == []


def test_a_replica_that_cannot_answer_is_a_503_to_retry():
    """ReplicaUnavailableError (a replica failed or cannot be reached, after the client's retries) is an
    EngineUnavailableError, which the API answers 503 with retry-after, not a 500."""
    from loraplex.platform.errors import from_engine_error
    from loraplex.ray_serve.client import ReplicaUnavailableError

    answer = from_engine_error(ReplicaUnavailableError("engine replica failed: ActorDiedError"))
    assert answer.status == 503 and answer.code == "replica_unavailable" and answer.headers["retry-after"] == "1"
    assert "ActorDiedError" not in answer.message  # (the cause is logged, not shown to the tenant)


def _events(n: int, fail: bool = False, closed: list | None = None):
    async def gen():
        try:
            for i in range(n):
                yield i
                await asyncio.sleep(0)
            if fail:
                raise RuntimeError("engine failed")
        finally:
            if closed is not None:
                closed.append(True)
    return gen()


def test_a_replica_sends_the_events_that_piled_up_as_one_item_and_loses_none():
    from loraplex.ray_serve.replica import coalesced

    async def read(source, pause: float) -> list[list[int]]:
        out = []
        async for batch in coalesced(source):
            out.append(batch)
            await asyncio.sleep(pause)  # a slow stream: events pile up meanwhile
        return out

    slow = asyncio.run(read(_events(50), 0.01))
    assert [e for b in slow for e in b] == list(range(50)) and len(slow) < 50 and slow[0] == [0]
    fast = asyncio.run(read(_events(5), 0))
    assert [e for b in fast for e in b] == list(range(5))
    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(read(_events(3, fail=True), 0))


def test_a_stream_item_holds_at_most_its_bound_of_events():
    """(a gRPC message holds 4 MiB: a stream that stalled long sends what piled up in several items)"""
    from loraplex.ray_serve.replica import EVENTS_PER_ITEM, coalesced

    async def read_after_a_stall() -> list[list[int]]:
        out = []
        async for batch in coalesced(_events(3 * EVENTS_PER_ITEM)):
            out.append(batch)
            if len(out) == 1:
                await asyncio.sleep(0.2)  # every other event piles up meanwhile
        return out

    batches = asyncio.run(read_after_a_stall())
    assert [e for b in batches for e in b] == list(range(3 * EVENTS_PER_ITEM))
    assert max(len(b) for b in batches) == EVENTS_PER_ITEM


def test_closing_the_stream_closes_the_engine_side():
    from loraplex.ray_serve.replica import coalesced

    closed: list = []

    async def take_one():
        stream = coalesced(_events(10**6, closed=closed))
        first = await anext(stream)
        await stream.aclose()  # what a cancelled Serve stream does
        return first

    assert asyncio.run(take_one()) == [0] and closed == [True]


@pytest.mark.slow
@pytest.mark.parametrize("cached", [True, False])
def test_the_gateway_reads_the_tokenizer_the_engine_loads(tmp_path, cached):
    """A gateway before Ray Serve replicas tokenizes with load_tokenizer (no weights read): the same tokenizer as
    load_model's, from the GGUF cache's metadata or, without a cache, from the GGUF itself."""
    from loraplex.engine.models.loader import load_model, load_tokenizer, resolve_model

    source = resolve_model("smollm2-135m")
    loaded = load_model(source)
    tokenizer = load_tokenizer(source, loaded.config, cache_dir=None if cached else tmp_path)
    assert tokenizer.to_json() == loaded.tokenizer.to_json()
    assert not any(tmp_path.iterdir())  # (nothing dequantized or written)
