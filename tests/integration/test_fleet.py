"""An EngineFleet over real `loraplex worker` processes: same answers as a local engine, adapters kept
on their worker, load spilling, errors as the engine raises them, aborts, and a worker's loss and return."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from loraplex.engine.api import (
    ContextLengthExceededError,
    EngineError,
    GenerateRequest,
    InvalidRequestError,
    ModelNotFoundError,
    SamplingParams,
)
from loraplex.fleet import placement
from loraplex.fleet.fleet import EngineFleet
from loraplex.fleet.remote import RemoteWorker, WorkerUnavailableError
from tests.e2e.server import start_worker

MODEL = "synthetic:tiny"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def workers():
    pair = [start_worker({}), start_worker({})]
    yield pair
    for w in pair:
        w.stop()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from tests.conftest import _loaded
    from tests.lora_factory import make_peft_dir

    config = _loaded(MODEL).config
    root = tmp_path_factory.mktemp("fleet-peft")
    return [str(make_peft_dir(root / f"a{i}", config, rank=8, alpha=16, targets="all", seed=i + 1)) for i in range(8)]


def fleet_of(servers, **kwargs) -> EngineFleet:
    fleet = EngineFleet([RemoteWorker(s.base_url) for s in servers], **kwargs)
    fleet.connect()
    return fleet


def request(rid: str, prompt: str = "hello fleet", adapter: str | None = None, sampling=GREEDY, **kw):
    return GenerateRequest(rid, MODEL, prompt=prompt, adapter=adapter, sampling=sampling, **kw)


async def tokens_of(engine, req) -> tuple[int, ...]:
    events = [e async for e in engine.generate(req)]
    assert events[-1].finish_reason == "length"
    return tuple(t for e in events for t in e.token_ids)


async def at_once(fleet: EngineFleet, adapter: str, count: int, max_tokens: int) -> None:
    """`count` requests for the adapter, all placed before any ends."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    await asyncio.gather(*(tokens_of(fleet, request(f"{adapter}-{i}", adapter=adapter, sampling=sampling))
                           for i in range(count)))


def run(fleet: EngineFleet, body):
    async def main():
        await fleet.start()
        try:
            return await body()
        finally:
            await fleet.close()
    return asyncio.run(main())


def test_answers_as_a_local_engine_does_with_and_without_an_adapter(workers, adapters):
    from loraplex.engine.async_engine import AsyncEngine
    from tests.conftest import make_core

    local = AsyncEngine(make_core())
    fleet = fleet_of(workers)
    try:
        local.add_adapter("a0", adapters[0])
        fleet.add_adapter("a0", adapters[0])

        async def body():
            for adapter in (None, "a0"):
                req = request(f"eq-{adapter}", adapter=adapter)
                prepared = await fleet.prepare(req)
                assert prepared == await local.prepare(req) and prepared.messages is None
                assert await tokens_of(fleet, req) == await tokens_of(local, req)
            assert await tokens_of(fleet, request("x", adapter="a0")) != await tokens_of(fleet, request("y"))
        run(fleet, body)
    finally:
        local.shutdown()
    assert fleet.models()[0].name == MODEL and fleet.has_adapter("a0") and not fleet.has_adapter("a1")


def test_each_adapter_stays_on_one_worker_and_the_adapters_spread_over_both(workers, adapters):
    fleet = fleet_of(workers)
    before = {url: h.stats.adapter_loads for url, h in fleet.health.items()}
    names = [f"spread{i}" for i in range(len(adapters))]
    for name, path in zip(names, adapters, strict=True):
        fleet.add_adapter(name, path)

    async def body():
        for _ in range(3):
            for name in names:
                await tokens_of(fleet, request(f"{name}-{_}", adapter=name))
        await fleet.poll()
    run(fleet, body)
    urls = list(fleet.workers)
    holders = {name: [u for u in urls if (MODEL, name) in fleet.registered(u)] for name in names}
    assert holders == {name: [placement.ranked(placement.placement_key(MODEL, name, None), urls)[0]]
                       for name in names}
    loads = sum(h.stats.adapter_loads - before[url] for url, h in fleet.health.items())
    assert loads == len(names)  # every adapter loaded into one worker's slot, once


def test_a_hot_adapter_spills_to_the_second_worker_under_load(workers, adapters):
    fleet = fleet_of(workers)
    fleet.add_adapter("hot", adapters[0])
    run(fleet, lambda: at_once(fleet, "hot", 8, 64))
    # all 8 placed before any ends, each within ceil(1.25 * (in flight + 1) / 2): the first-ranked worker
    # takes 1, 2, -, 3, 4, -, 5, - and the other the rest
    assert sorted(fleet.routed.values()) == [3, 5]
    assert all((MODEL, "hot") in fleet.registered(u) for u in fleet.workers)


def test_errors_come_back_as_the_engine_raised_them(workers, tmp_path):
    fleet = fleet_of(workers)

    async def body():
        with pytest.raises(ModelNotFoundError):
            await fleet.prepare(GenerateRequest("m", "no-such-model", prompt="x"))
        with pytest.raises(ContextLengthExceededError) as too_long:
            await tokens_of(fleet, request("long", sampling=SamplingParams(max_tokens=100_000)))
        assert too_long.value.param == "messages" and "maximum context length" in too_long.value.message
        with pytest.raises(ModelNotFoundError, match="adapter 'unregistered' not found"):
            await fleet.prepare(request("u", adapter="unregistered"))
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(InvalidRequestError) as bad:
        fleet.add_adapter("pickled", str(tmp_path))
    assert bad.value.code == "invalid_adapter" and "adapter_config.json is missing" in bad.value.message
    assert not fleet.has_adapter("pickled")
    run(fleet, body)


def test_an_abort_and_a_caller_that_leaves_both_free_the_request_on_its_worker(workers):
    fleet = fleet_of(workers)
    endless = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)

    async def running() -> int:
        await fleet.poll()
        return sum(h.stats.running + h.stats.waiting for h in fleet.health.values())

    async def settle() -> int:
        for _ in range(100):
            if await running() == 0:
                return 0
            await asyncio.sleep(0.05)
        return await running()

    async def body():
        stream = fleet.generate(request("to-abort", sampling=endless))
        await anext(stream)
        usage = await fleet.abort("to-abort")
        assert usage is not None and usage.completion_tokens >= 1
        rest = [e async for e in stream]
        assert rest[-1].finish_reason == "abort"
        assert await settle() == 0

        left = fleet.generate(request("to-leave", sampling=endless))
        await anext(left)
        assert await running() == 1
        await left.aclose()  # the caller went away
        assert await settle() == 0
        assert await fleet.abort("to-leave") is None  # (nothing left in flight)
    run(fleet, body)


def test_removing_an_adapter_takes_it_off_every_worker(workers, adapters):
    fleet = fleet_of(workers)
    fleet.add_adapter("gone", adapters[1])

    async def body():
        await at_once(fleet, "gone", 6, 48)
        assert all((MODEL, "gone") in fleet.registered(u) for u in fleet.workers)  # (it spilled to both)
        await fleet.remove_adapter("gone")
        with pytest.raises(ModelNotFoundError):
            await fleet.prepare(request("after", adapter="gone"))
    run(fleet, body)
    for w in workers:
        present = httpx.get(f"{w.base_url}/engine/adapters", params={"adapter_id": "gone"}).json()["present"]
        assert present is False
    assert not fleet.has_adapter("gone")


def test_a_lost_worker_fails_its_streams_and_its_return_is_noticed(adapters):
    pair = [start_worker({}), start_worker({})]
    try:
        fleet = fleet_of(pair)
        fleet.add_adapter("a", adapters[2])
        victim = placement.ranked(placement.placement_key(MODEL, "a", None), list(fleet.workers))[0]
        server = next(s for s in pair if s.base_url == victim)
        port = victim.rsplit(":", 1)[1]
        endless = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)

        async def body():
            stream = fleet.generate(request("doomed", adapter="a", sampling=endless))
            await anext(stream)
            server.proc.kill()
            server.proc.wait()
            # the fleet has not polled since: an adapter that ranks the lost worker first is validated by the other
            late = next(n for n in (f"late{i}" for i in range(32))
                        if placement.ranked(placement.placement_key(MODEL, n, None), list(fleet.workers))[0] == victim)
            fleet.add_adapter(late, adapters[3])
            assert fleet.has_adapter(late) and fleet.health[victim] is None
            assert [u for u in fleet.workers if (MODEL, late) in fleet.registered(u)] == [
                u for u in fleet.workers if u != victim]
            with pytest.raises(WorkerUnavailableError):
                async for _ in stream:
                    pass
            # requests go to the worker left, which is given the adapter on demand
            assert len(await tokens_of(fleet, request("after-loss", adapter="a"))) == 12
            assert fleet.health[victim] is None and fleet.models()[0].name == MODEL
            pair.append(start_worker({}, "--port", port))
            await fleet.poll()
            assert fleet.health[victim] is not None and (MODEL, "a") not in fleet.registered(victim)
            assert len(await tokens_of(fleet, request("returned", adapter="a"))) == 12  # registered again
            assert (MODEL, "a") in fleet.registered(victim)
        run(fleet, body)
    finally:
        for s in pair:
            s.stop()


def test_a_request_whose_first_worker_has_every_slot_busy_goes_where_one_is_free(adapters):
    pair = [start_worker({}, "--max-loras", "1"), start_worker({}, "--max-loras", "1")]
    try:
        fleet = fleet_of(pair)
        urls = list(fleet.workers)
        assert all(h.stats.adapter_slots == 1 for h in fleet.health.values())
        first = {name: placement.ranked(placement.placement_key(MODEL, name, None), urls)[0]
                 for name in (f"s{i}" for i in range(16))}
        a, b = next((x, y) for x in first for y in first if x != y and first[x] == first[y])
        fleet.add_adapter(a, adapters[3])
        fleet.add_adapter(b, adapters[4])
        endless = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)

        async def body():
            running = fleet.generate(request("holds-the-slot", adapter=a, sampling=endless))
            await anext(running)
            await tokens_of(fleet, request("other", adapter=b))  # a holds their first worker's one slot
            assert fleet.routed[first[a]] == 1
            await tokens_of(fleet, request("same", adapter=a))  # joins a where it runs
            await running.aclose()
        run(fleet, body)
        assert fleet.routed[first[a]] == 2 and sum(fleet.routed.values()) == 3
    finally:
        for s in pair:
            s.stop()


def test_a_stream_from_a_worker_that_stops_answering_fails_within_its_idle_limit():
    server = start_worker({})
    try:
        fleet = EngineFleet([RemoteWorker(server.base_url, stream_idle_s=2.0)])
        fleet.connect()
        endless = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)

        async def body():
            stream = fleet.generate(request("frozen", sampling=endless))
            await anext(stream)
            os.kill(server.proc.pid, signal.SIGSTOP)  # alive, connected, silent
            try:
                started = time.monotonic()
                with pytest.raises(WorkerUnavailableError, match="ReadTimeout"):
                    async for _ in stream:
                        pass
                return time.monotonic() - started
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
        assert run(fleet, body) < 10  # not the 30 s of a call: the stream's own 2 s, without an abort call after
        assert fleet.health[server.base_url] is None
    finally:
        server.stop()


def test_a_worker_with_a_token_refuses_calls_without_it():
    server = start_worker({"LORAPLEX_WORKER_TOKEN": "s3cret"})
    try:
        assert httpx.get(f"{server.base_url}/engine/health").status_code == 401
        with pytest.raises(EngineError, match="401"):
            RemoteWorker(server.base_url, "wrong").health_now()
        with pytest.raises(WorkerUnavailableError, match="no worker answers: worker answered HTTP 401"):
            EngineFleet([RemoteWorker(server.base_url, "wrong")]).connect()
        wrong = server.base_url.replace("127.0.0.1", "localhost")  # the same worker, called without its token
        fleet = EngineFleet([RemoteWorker(server.base_url, "s3cret"), RemoteWorker(wrong, "wrong")])
        fleet.connect()
        assert fleet.health[wrong] is None and fleet.health[server.base_url] is not None

        async def body():
            await fleet.poll()  # a worker refusing the poll counts as lost; the others go on
            assert fleet.health[wrong] is None
            return await tokens_of(fleet, request("t"))
        assert run(fleet, body)
    finally:
        server.stop()


def test_no_worker_answering_is_one_clear_error():
    fleet = EngineFleet([RemoteWorker("http://127.0.0.1:9")])
    with pytest.raises(WorkerUnavailableError, match="no worker answers"):
        fleet.connect()
