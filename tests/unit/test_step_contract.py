"""The step contract: the runner returns a StepOutput and writes nothing onto requests (the scheduler
updates them from that output alone), and the KV manager's per-request block bookkeeping."""

from __future__ import annotations

import copy

import pytest

from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.kv.block_pool import BlockPool
from loraplex.engine.kv.manager import KVManager
from loraplex.engine.sched.request import Request
from tests.conftest import make_core
from tests.unit.test_engine_core import MODEL
from tests.unit.test_speculative import repetitive_prompts

# --- the runner writes nothing onto requests -------------------------------------------------------

SHARED = repetitive_prompts(1, seed=5)[0][:48]  # 3 full blocks of 16: a prefix a later request hits


def _req(rid: str, ids: list[int], max_tokens: int = 24, **kw) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp)


def _phases() -> list[list[GenerateRequest]]:
    """A warm request first (its prompt's blocks then sit in the prefix cache), then a batch with a
    prefix hit, prompt and sampled log-probabilities, and prompts long enough to be chunked."""
    prompts = repetitive_prompts(3, seed=11)
    return [[_req("warm", SHARED + [40, 41], max_tokens=8)],
            [_req("hit", SHARED + [42, 43, 44], logprobs=2), _req("scored", prompts[0], prompt_logprobs=2),
             _req("a", prompts[1]), _req("b", prompts[2] + prompts[1], logprobs=0)]]


def _snapshot(r: Request) -> dict:
    """A request's state by value (its RNG and schema guide are objects the sampler uses, not results)."""
    return {k: copy.deepcopy(v) for k, v in vars(r).items() if k not in ("generator", "guide", "bias")}


def _run(core, freeze: bool) -> tuple[dict, list]:
    """Runs the phases to the end; returns each request's tokens and prompt/sampled logprobs, and the
    step outputs seen. With `freeze`, every request in the engine is read-only inside the runner's launch
    and its output."""
    outputs, inside = [], [False]
    launch = core.runner.launch

    def frozen_setattr(obj, name, value):
        if inside[0]:
            raise AssertionError(f"the runner set {name} on request {obj.request_id}")
        object.__setattr__(obj, name, value)

    def checked_launch(batch, previous=None):
        before = {r.request_id: _snapshot(r) for r in core.requests.values()}
        inside[0] = True
        try:
            launched = launch(batch, previous)
            out = launched.output()
        finally:
            inside[0] = False
        assert {r.request_id: _snapshot(r) for r in core.requests.values()} == before
        outputs.append(out)
        return launched

    got: dict[str, list] = {}
    mp = pytest.MonkeyPatch()
    try:
        if freeze:
            mp.setattr(Request, "__setattr__", frozen_setattr, raising=False)
            core.runner.launch = checked_launch
        for phase in _phases():
            for r in phase:
                core.add_request(r)
            while core.has_work():
                for ev in core.step():
                    tokens, lps, prompt = got.setdefault(ev.request_id, ([], [], []))
                    tokens.extend(ev.token_ids)
                    lps.extend((e.token_id, e.logprob) for e in ev.logprobs)
                    prompt.extend((e.token_id, e.logprob) for e in ev.prompt_logprobs[1:])  # (the first has none)
    finally:
        mp.undo()
    return got, outputs


@pytest.mark.parametrize("mode", ["roomy", "swap"])
def test_execute_writes_nothing_onto_requests_and_the_tokens_are_a_plain_runs(mode):
    """Drafts (some rejected), prompt log-probabilities, chunked prefill and a prefix hit in the run,
    and with a tight pool preemption by swap too: no request changes inside execute, and the engine
    gives the tokens and log-probabilities of a run with none of those features."""
    tight = {"num_kv_blocks": 12, "preemption_mode": "swap"} if mode == "swap" else {}
    core = make_core(speculative_tokens=4, speculative_max_seqs=8, max_num_batched_tokens=40, **tight)
    got, outputs = _run(core, freeze=True)
    want, _ = _run(make_core(enable_prefix_caching=False), freeze=False)
    assert {rid: tokens for rid, (tokens, _, _) in got.items()} == {rid: t for rid, (t, _, _) in want.items()}
    for rid, (_, lps, prompt) in want.items():
        for have, should in ((got[rid][1], lps), (got[rid][2], prompt)):
            assert [i for i, _ in have] == [i for i, _ in should]
            assert [lp for _, lp in have] == pytest.approx([lp for _, lp in should], abs=1e-4)
    stats = core.stats()
    assert stats.kv.prefix_hit_tokens >= 48 and 0 < stats.speculation.accepted_tokens < stats.speculation.draft_tokens
    assert any(sum(out.num_rejected) for out in outputs)  # drafts were rejected
    assert any(out.prompt_logprobs for out in outputs)
    assert len(got["scored"][2]) == len(_phases()[1][1].prompt_token_ids) - 1 and got["hit"][1]
    assert any(not out.tokens for out in outputs)  # a step of prefill chunks alone sampled nothing
    if mode == "swap":
        assert stats.kv.swapped_out_blocks > 0 and stats.kv.swapped_in_blocks > 0
    assert stats.kv.blocks_used == 0 and stats.kv.swap_blocks_used == 0


# --- KVManager -------------------------------------------------------------------------------------

BS = 4


def _request(rid: str, ids: list[int], adapter: str | None = None, salt: str | None = None, **sp) -> Request:
    return Request(rid, list(ids), SamplingParams(max_tokens=8, temperature=0.0, **sp), max_tokens=8,
                   stop_ids=frozenset(), adapter=adapter, cache_salt=salt)


def _computed(kv: KVManager, req: Request, n: int, kept: list[int] = ()) -> None:
    """What Scheduler.update does after a step that computed n tokens of req."""
    req.num_computed += n
    kv.cache_full_blocks(req, list(kept))


def test_start_and_grow_allocate_all_or_nothing():
    pool = BlockPool(6, BS)
    kv = KVManager(pool)
    a = _request("a", range(10))
    assert kv.start(a, 6) and len(a.blocks) == 2 and a.num_computed == 0  # the first chunk: 6 tokens
    assert kv.grow(a, 10) and len(a.blocks) == 3  # (past num_computed) all 10 tokens
    assert kv.grow(a, 12) and len(a.blocks) == 3  # 12 still fit
    assert not kv.grow(a, 30) and len(a.blocks) == 3 and pool.num_free == 3  # 10 blocks: takes none
    b = _request("b", range(100, 120))
    assert not kv.start(b, 20) and b.blocks == [] and pool.num_free == 3  # 5 blocks do not fit
    assert kv.stats.prefix_query_tokens == 10  # a failed start is no admission
    kv.free(a)
    assert pool.num_free == 6 and a.blocks == []


def test_full_blocks_are_cached_and_a_later_request_hits_them():
    pool = BlockPool(16, BS)
    kv = KVManager(pool, model="m")
    a = _request("a", range(10))
    assert kv.start(a, 10)
    _computed(kv, a, 10)
    assert a.num_registered == 2 and pool.num_cached == 2  # 10 tokens: 2 full blocks
    b = _request("b", [*range(8), 50, 51, 52])
    assert kv.start(b, 11)
    assert b.num_computed == 8 and b.blocks[:2] == a.blocks[:2] and b.num_cached == 8
    assert len(b.blocks) == 3 and b.blocks[2] not in a.blocks  # its own block for the rest
    assert (kv.stats.prefix_query_tokens, kv.stats.prefix_hit_tokens) == (10 + 11, 8)
    exact = _request("exact", range(8))  # the last token is always computed: only 1 block is reusable
    assert kv.start(exact, 8) and exact.num_computed == 4
    kv.free(a)
    kv.free(b)
    kv.free(exact)
    assert pool.num_free == 16 and pool.num_cached == 2  # freed, still cached for later hits


def test_no_hit_across_salts_adapters_registrations_or_for_prompt_logprobs():
    pool = BlockPool(32, BS)
    registrations = {"x": 1}
    kv = KVManager(pool, model="m", registration=registrations.__getitem__)
    a = _request("a", range(12), adapter="x")
    assert kv.start(a, 12)
    _computed(kv, a, 12)
    assert kv.start(same := _request("same", range(12), adapter="x"), 12) and same.num_computed == 8
    for other in (_request("salt", range(12), adapter="x", salt="s"), _request("base", range(12)),
                  _request("scored", range(12), adapter="x", prompt_logprobs=1)):
        assert kv.start(other, 12) and other.num_computed == 0, other.request_id
    registrations["x"] = 2  # registered again, maybe over other weights
    assert kv.start(again := _request("again", range(12), adapter="x"), 12) and again.num_computed == 0


def test_kept_drafts_hash_like_the_tokens_they_become():
    pool = BlockPool(16, BS)
    kv = KVManager(pool)
    a = _request("a", range(6))
    assert kv.start(a, 6)
    _computed(kv, a, 6)
    a.output_ids.append(70)  # its first sampled token
    assert kv.grow(a, 3)  # that token and 2 drafts, both kept: 9 tokens, 2 full blocks
    _computed(kv, a, 3, kept=[71, 72])  # block 1 holds 4, 5, 70 and the first draft
    a.output_ids.extend([71, 72, 73])  # (the core appends the kept drafts and the token after them)
    b = _request("b", [0, 1, 2, 3, 4, 5, 70, 71, 72, 9])
    assert b.num_tokens == 10 and kv.start(b, 10) and b.num_computed == 8 and b.blocks[:2] == a.blocks[:2]


def test_prefill_blocks_and_the_next_uncached_one():
    pool = BlockPool(16, BS)
    kv = KVManager(pool)
    a = _request("a", range(13))
    assert kv.start(a, 6)
    _computed(kv, a, 6)  # block 0 cached; blocks 1 and 2 of its prompt still to compute
    todo = kv.prompt_blocks_to_compute(a)
    assert todo == a.block_hashes[1:3] and kv.blocks_in_prefill([a]) == set(todo)
    b = _request("b", [*range(12), 99])
    assert kv.next_uncached_block(b) == todo[0]  # b's first missing block is the one a computes next
    assert kv.next_uncached_block(_request("c", [1, 2, 3, 4, 5])) is not None
    assert kv.next_uncached_block(_request("d", range(5))) is None  # its one usable block is cached
    off = KVManager(BlockPool(4, BS), prefix_caching=False)
    assert off.prompt_blocks_to_compute(a) == [] and off.next_uncached_block(b) is None


def test_preempt_swaps_out_when_there_is_room_and_every_block_comes_back():
    pool, swap = BlockPool(8, BS), BlockPool(3, BS)
    kv = KVManager(pool, swap_pool=swap)
    a, b = _request("a", range(10)), _request("b", range(20, 30))
    assert kv.start(a, 10) and kv.start(b, 10)
    _computed(kv, a, 10)
    device = list(a.blocks)
    assert kv.preempt(a) == (device, a.swap_blocks) and len(a.swap_blocks) == 3
    assert a.blocks == [] and a.num_registered == 0 and pool.num_free == 5 and swap.num_free == 0
    assert kv.preempt(b) is None and b.blocks == [] and pool.num_free == 8  # no swap room: dropped
    cpu = list(a.swap_blocks)
    got = kv.swap_in(a, 1)  # its 10 tokens back, and the 11th
    assert got is not None and got[0] == cpu and a.blocks[:3] == got[1] and len(a.blocks) == 3
    assert a.swap_blocks == [] and swap.num_free == 0  # held until the copy ran
    kv.free_swap(got[0])
    assert (kv.stats.swapped_out_blocks, kv.stats.swapped_in_blocks) == (3, 3)
    kv.free(a)
    assert pool.num_free == 8 and swap.num_free == 3
    assert kv.preempt(_request("none", [1])) is None  # holds nothing: nothing to copy


def test_free_returns_device_and_swap_blocks():
    pool, swap = BlockPool(4, BS), BlockPool(4, BS)
    kv = KVManager(pool, swap_pool=swap)
    a = _request("a", range(7))
    assert kv.start(a, 7)
    kv.preempt(a)  # swapped out, then finished while waiting
    assert swap.num_free == 2
    kv.free(a)
    assert pool.num_free == 4 and swap.num_free == 4 and a.swap_blocks == []
    assert kv.swap_in(_request("big", range(30)), 30) is None  # 8 blocks never fit: takes nothing
    assert pool.num_free == 4
