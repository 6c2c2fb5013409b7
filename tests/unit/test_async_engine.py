"""AsyncEngine: streaming events over asyncio, abort and consumer disconnect free the KV pool;
prepare() tokenizes once, off the caller's loop; a fault in the forward pass ends the requests it
held with an error and the engine serves the next one."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from loraplex.engine.api import MAX_LOGIT_BIAS, GenerateRequest, InvalidRequestError, SamplingParams
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
        if s.requests.running == s.requests.waiting == 0 and s.kv.blocks_used == 0:
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


class CountingTokenizer:
    """The real tokenizer, counting its encode and chat-template calls and the threads they ran on."""

    def __init__(self, real):
        self.real = real
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def encode(self, *args, **kwargs):
        self.calls.append(("encode", threading.current_thread().name))
        return self.real.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls.append(("chat_template", threading.current_thread().name))
        return self.real.apply_chat_template(*args, **kwargs)


def counting_tokenizer(engine: AsyncEngine, model: str = MODEL) -> CountingTokenizer:
    """Wraps the tokenizer of `model`'s frontend (this engine's own: the shared loaded model is untouched)."""
    frontend = engine.pool.models[model].frontend
    frontend.tokenizer = CountingTokenizer(frontend.tokenizer)
    return frontend.tokenizer


async def _collect(engine: AsyncEngine, request: GenerateRequest) -> list:
    return [e async for e in engine.generate(request)]


def test_prepare_tokenizes_once_off_the_loop_and_changes_nothing_generated(engine):
    tokenizer = counting_tokenizer(engine)
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    asked = GenerateRequest("chat", MODEL, messages=({"role": "user", "content": "tell me a story"},),
                            sampling=sampling)

    async def go():
        direct = await _collect(engine, asked)  # tokenized by generate() itself, on this loop
        calls = len(tokenizer.calls)
        prepared = await engine.prepare(dataclasses.replace(asked, request_id="chat-prepared"))
        assert prepared.messages is None and prepared.prompt is None and prepared.prompt_token_ids
        on_threads = {thread for _, thread in tokenizer.calls[calls:]}
        after = await _collect(engine, prepared)
        choices = await asyncio.gather(*(_collect(engine, dataclasses.replace(prepared, request_id=f"c{i}"))
                                         for i in range(3)))
        return direct, calls, on_threads, after, choices

    direct, calls, on_threads, after, choices = asyncio.run(go())
    assert calls == 2  # the direct request: its chat template, then its text
    assert len(tokenizer.calls) == 4  # prepare() did the same once; generate() of its result, 4 times, nothing
    assert on_threads and all(t.startswith("loraplex-prepare") for t in on_threads)

    def seen(events):
        last = events[-1]
        return ("".join(e.text for e in events), [t for e in events for t in e.token_ids],
                [lp for e in events for lp in e.logprobs], events[0].prompt_logprobs,
                last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens)

    assert seen(after) == seen(direct)
    assert all(seen(c)[:2] == seen(direct)[:2] for c in choices)


def test_prepare_refuses_what_generate_refuses(engine):
    async def go():
        with pytest.raises(InvalidRequestError) as empty:
            await engine.prepare(GenerateRequest("x", MODEL, prompt="", sampling=SamplingParams()))
        too_many = tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))
        with pytest.raises(InvalidRequestError) as biased:
            await engine.prepare(greedy("b", [1, 2], logit_bias=too_many))
        with pytest.raises(InvalidRequestError) as twice:
            await engine.prepare(greedy("d", [1, 2], logit_bias=((5, 1.0), (5, -1.0))))
        fine = await engine.prepare(greedy("ok", [1, 2], logit_bias=too_many[:MAX_LOGIT_BIAS]))
        await _wait_idle(engine)
        return empty.value, biased.value, twice.value, fine

    empty, biased, twice, fine = asyncio.run(go())
    assert empty.param == "prompt"
    assert biased.param == twice.param == "logit_bias" and "more than once" in twice.message
    assert fine.prompt_token_ids == (1, 2)


def test_a_fault_in_the_forward_pass_ends_every_request_and_the_engine_goes_on(engine, monkeypatch):
    model = engine.core.runner.model
    real_forward, fault = model.forward, threading.Event()

    def forward(*args, **kwargs):
        if fault.is_set():
            fault.clear()
            raise RuntimeError("injected forward-pass fault")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)

    async def one(rid: str, started: asyncio.Event):
        events = []
        async for e in engine.generate(greedy(rid, [1, 2, 3, 4], max_tokens=1000)):
            events.append(e)
            if len(events) == 2:
                started.set()
        return events

    async def go():
        started = [asyncio.Event() for _ in range(3)]
        runs = [asyncio.ensure_future(one(f"f{i}", s)) for i, s in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
        fault.set()
        ended = await asyncio.wait_for(asyncio.gather(*runs), 10)
        await _wait_idle(engine)
        after = await asyncio.wait_for(_collect(engine, greedy("next", [1, 2, 3], max_tokens=5)), 30)
        return ended, after

    ended, after = asyncio.run(go())
    for events in ended:
        last = events[-1]
        assert last.finish_reason == "error" and "injected forward-pass fault" in last.error
        assert last.usage.completion_tokens == sum(len(e.token_ids) for e in events) >= 2  # billed what it got
        assert last.usage.prompt_tokens == 4
    assert after[-1].finish_reason == "length" and after[-1].usage.completion_tokens == 5
    assert engine.stats().kv.blocks_used == 0


def test_a_prepared_schema_is_never_compiled_on_the_event_loop(engine, monkeypatch):
    """prepare() compiles a request's schema on its own threads; if other schemas push the compiled grammar out
    of the cache before generate(), generate() answers 503 (retry) instead of compiling on the caller's loop,
    where the compile would hold every other request on it."""
    from loraplex.engine.api import EngineUnavailableError
    from loraplex.engine.guided.grammar import GrammarCache

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    req = GenerateRequest("s", MODEL, prompt_token_ids=(1, 2, 3),
                          sampling=SamplingParams(max_tokens=4, temperature=0.0, json_schema=schema))
    loop_compiles = []
    compile_ = GrammarCache._compile

    def watched(self, text, owner):
        loop_compiles.append(threading.current_thread().name)
        return compile_(self, text, owner)

    monkeypatch.setattr(GrammarCache, "_compile", watched)

    async def go():
        prepared = await engine.prepare(req)
        assert loop_compiles and loop_compiles[0].startswith("loraplex-prepare")  # compiled off the loop
        ok = [e async for e in engine.generate(prepared)]  # still cached: served without a second compile
        assert ok[-1].finished and len(loop_compiles) == 1
        engine.pool.entry(MODEL).frontend.grammars._entries.clear()  # other schemas took its place
        with pytest.raises(EngineUnavailableError, match="pushed it out of the cache"):
            engine.generate(dataclasses.replace(prepared, request_id="s2"))
        assert len(loop_compiles) == 1  # nothing compiled on the loop
        await _wait_idle(engine)

    asyncio.run(go())
