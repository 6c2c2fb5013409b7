"""AsyncEngine: streaming events over asyncio, abort and consumer disconnect free the KV pool."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine.api import GenerateRequest, InvalidRequestError, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from tests.conftest import make_core
from tests.unit.test_engine_core import MODEL, greedy


@pytest.fixture
def engine():
    eng = AsyncEngine(make_core())
    yield eng
    eng.shutdown()


async def _wait_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        s = engine.stats()
        if s.running == s.waiting == 0 and s.kv_blocks_used == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not return to idle: {engine.stats()}")


def test_generate_streams_events_until_finish(engine):
    async def go():
        events = [e async for e in engine.generate(greedy("a", [1, 2, 3], max_tokens=9))]
        return events

    events = asyncio.run(go())  # one token per event, or several where speculation kept drafts
    assert sum(len(e.token_ids) for e in events) == 9 and all(e.token_ids for e in events)
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    last = events[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 9


def test_concurrent_requests_match_sync_results(engine):
    want = make_core().run([greedy(f"s{i}", [i + 1, 2, 3], max_tokens=12) for i in range(6)])

    async def one(i):
        ids = []
        async for e in engine.generate(greedy(f"c{i}", [i + 1, 2, 3], max_tokens=12)):
            ids.extend(e.token_ids)
        return ids

    async def go():
        return await asyncio.gather(*(one(i) for i in range(6)))

    assert asyncio.run(go()) == [c.token_ids for c in want]


def test_bad_request_raises_at_generate_and_queues_nothing(engine):
    async def go():
        with pytest.raises(InvalidRequestError):
            engine.generate(GenerateRequest("x", MODEL, prompt="", sampling=SamplingParams()))
        await _wait_idle(engine)

    asyncio.run(go())


def test_abort_mid_decode_frees_blocks(engine):
    async def go():
        stream = engine.generate(greedy("long", [1, 2, 3], max_tokens=500))
        got = []
        usage = None
        async for e in stream:
            got.append(e)
            if len(got) == 3:
                usage = await engine.abort("long")
        assert got[-1].finish_reason == "abort"
        assert got[-1].usage == usage and usage.completion_tokens >= 3 and usage.prompt_tokens == 3
        assert await engine.abort("long") is None  # already gone
        await _wait_idle(engine)

    asyncio.run(go())


def test_consumer_that_walks_away_aborts_its_request(engine):
    async def go():
        stream = engine.generate(greedy("gone", [4, 5, 6], max_tokens=500))
        async for _ in stream:
            break  # the client disconnected
        await stream.aclose()
        await _wait_idle(engine)

    asyncio.run(go())
