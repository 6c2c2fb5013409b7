"""EngineCore on a synthetic tiny model: batching, chunked prefill, KV accounting, bad input."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.api import (
    ContextLengthExceededError,
    GenerateRequest,
    InvalidRequestError,
    ModelNotFoundError,
    SamplingParams,
)
from tests.conftest import make_core

MODEL = "synthetic:tiny"


def greedy(rid: str, ids, max_tokens: int = 24, **kw) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp)


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 120))] for _ in range(n)]


def test_batch_of_16_matches_each_request_alone():
    prompts = mixed_prompts(16)
    alone = []
    for i, p in enumerate(prompts):
        core = make_core()
        alone.append(core.run([greedy(f"a{i}", p)])[0].token_ids)
    core = make_core(max_num_batched_tokens=256)
    batched = core.run([greedy(f"b{i}", p) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in batched] == alone
    assert all(len(t) == 24 for t in alone)


def test_chunked_prefill_matches_unchunked():
    prompts = mixed_prompts(6, seed=1)
    whole = make_core(max_num_batched_tokens=4096).run([greedy(f"w{i}", p) for i, p in enumerate(prompts)])
    chunked_core = make_core(max_num_batched_tokens=16)
    chunked = chunked_core.run([greedy(f"c{i}", p) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in chunked] == [c.token_ids for c in whole]
    # a chunk of 16 really split the prompts: more steps than tokens generated alone would need
    assert chunked_core.num_steps > 24 + max(len(p) for p in prompts) // 16


def test_requests_join_and_leave_every_step():
    core = make_core(max_num_seqs=4)
    reqs = [greedy(f"r{i}", p, max_tokens=3 + 5 * i) for i, p in enumerate(mixed_prompts(10, seed=2))]
    done = core.run(reqs)
    assert [len(c.token_ids) for c in done] == [3 + 5 * i for i in range(10)]
    assert all(c.finish_reason == "length" for c in done)


def test_every_block_is_free_after_finish_and_abort():
    core = make_core()
    total = core.pool.num_blocks
    core.run([greedy(f"f{i}", p) for i, p in enumerate(mixed_prompts(5))])
    assert core.pool.num_free == total
    for i, p in enumerate(mixed_prompts(4, seed=3)):
        core.add_request(greedy(f"x{i}", p, max_tokens=50))
    core.step()  # prefill
    core.step()  # a decode
    assert core.pool.num_used > 0
    events = [core.abort(f"x{i}") for i in range(4)]
    assert all(e.finish_reason == "abort" for e in events)
    assert core.pool.num_free == total
    assert core.stats().requests.running == core.stats().requests.waiting == 0
    assert core.abort("x0") is None  # already gone


def test_kv_pool_pressure_preempts_and_keeps_outputs():
    prompts = mixed_prompts(6, seed=4)
    roomy = make_core().run([greedy(f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts)])
    tight_core = make_core(num_kv_blocks=14)
    tight = tight_core.run([greedy(f"t{i}", p, max_tokens=40) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in tight] == [c.token_ids for c in roomy]
    assert tight_core.scheduler.num_preemptions > 0
    assert tight_core.pool.num_free == 14


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"prompt": ""}, InvalidRequestError, "prompt"),
        ({"prompt_token_ids": ()}, InvalidRequestError, "prompt"),
        ({"prompt_token_ids": (1, 99999)}, InvalidRequestError, "prompt"),
        ({"prompt": "hi", "sampling": SamplingParams(max_tokens=-1)}, InvalidRequestError, "max_tokens"),
        ({"prompt": "hi", "sampling": SamplingParams(temperature=-0.5)}, InvalidRequestError, "temperature"),
        ({"prompt": "hi", "sampling": SamplingParams(top_p=0.0)}, InvalidRequestError, "top_p"),
        ({"prompt": "hi", "sampling": SamplingParams(top_p=1.5)}, InvalidRequestError, "top_p"),
        ({"prompt": "hi", "model": "no-such-model"}, ModelNotFoundError, "model"),
        ({"prompt_token_ids": (5,) * 300}, ContextLengthExceededError, "messages"),
        ({"prompt": "hi", "sampling": SamplingParams(max_tokens=300)}, ContextLengthExceededError, "messages"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(kwargs, error, param):
    core = make_core(max_model_len=256)
    before = core.stats()
    fields = {"model": MODEL, **kwargs}
    with pytest.raises(error) as info:
        core.add_request(GenerateRequest("bad", **fields))
    assert info.value.param == param
    assert info.value.message
    assert core.stats() == before
    assert not core.requests and not core.has_work()


def test_duplicate_request_id_is_refused():
    core = make_core()
    core.add_request(greedy("same", [1, 2, 3]))
    with pytest.raises(InvalidRequestError):
        core.add_request(greedy("same", [4, 5, 6]))
    assert len(core.requests) == 1


def test_usage_counts_prompt_and_completion_tokens():
    core = make_core()
    (done,) = core.run([greedy("u", [7] * 33, max_tokens=5)])
    assert done.usage.prompt_tokens == 33
    assert done.usage.completion_tokens == 5
    assert done.usage.cached_tokens == 0
    assert done.usage.ttft_s is not None and done.usage.ttft_s >= 0
