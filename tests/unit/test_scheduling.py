"""Priority classes, preemption (recompute and swap) and tenant/adapter-aware prefix caching."""

from __future__ import annotations

import pytest

from loraplex.engine.api import GenerateRequest, InvalidRequestError, SamplingParams
from loraplex.engine.kv.block_pool import BlockPool
from loraplex.engine.sched.queues import PriorityQueues
from loraplex.engine.sched.request import Request
from tests.conftest import _loaded, make_core
from tests.lora_factory import make_peft_dir
from tests.unit.test_engine_core import MODEL, greedy, mixed_prompts


def req(rid, ids, max_tokens=16, priority="standard", salt=None, adapter=None) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp, priority=priority,
                           cache_salt=salt, adapter=adapter)


# --- preemption -------------------------------------------------------------------------------


def test_a_step_that_fails_while_swapping_in_leaks_no_swap_space():
    """The pool ends every request of a model whose step raised; the swap-ins of that step had
    already moved their requests to device blocks, so their CPU blocks are freed by the core."""
    core = make_core(num_kv_blocks=14, preemption_mode="swap")
    for i, p in enumerate(mixed_prompts(6, seed=4)):
        core.add_request(req(f"r{i}", p, max_tokens=40))
    run, failed = core.runner.launch, []

    def launch(batch, previous=None):
        if batch.swap_in and not failed:
            failed.append(len(batch.swap_in))
            raise RuntimeError("injected fault")
        return run(batch, previous)

    core.runner.launch = launch
    for _ in range(500):
        try:
            core.step()
        except RuntimeError:
            break
    assert failed, "no step swapped a request in"
    for rid in list(core.requests):
        core.abort(rid)
    stats = core.stats()
    assert stats.kv.blocks_used == 0 and stats.kv.swap_blocks_used == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_preempts_and_outputs_match_a_roomy_pool(mode):
    prompts = mixed_prompts(6, seed=4)
    reqs = [greedy(f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts)]
    roomy = make_core(enable_prefix_caching=False).run(reqs)
    tight = make_core(num_kv_blocks=14, preemption_mode=mode)
    got = tight.run(reqs)
    assert [c.token_ids for c in got] == [c.token_ids for c in roomy]
    stats = tight.stats()
    assert sum(stats.requests.preemptions_by_class.values()) > 0
    if mode == "swap":
        assert stats.kv.swapped_out_blocks > 0 and stats.kv.swapped_in_blocks == stats.kv.swapped_out_blocks
    assert stats.kv.blocks_used == 0 and stats.kv.swap_blocks_used == 0


def test_lowest_class_newest_first_is_preempted():
    core = make_core(num_kv_blocks=12, max_num_batched_tokens=64)
    core.add_request(req("rt", [1] * 40, max_tokens=80, priority="realtime"))
    core.add_request(req("b-old", [2] * 40, max_tokens=80, priority="batch"))
    core.add_request(req("b-new", [3] * 40, max_tokens=80, priority="batch"))
    while core.stats().requests.preemptions_by_class["batch"] == 0:
        assert core.stats().requests.preemptions_by_class["realtime"] == 0
        core.step()
    victims = [r.request_id for r in core.requests.values() if r.num_preemptions]
    assert victims == ["b-new"]


def test_request_that_can_never_fit_is_refused_clearly():
    core = make_core(num_kv_blocks=4, block_size=16)  # 64 tokens of KV in all
    with pytest.raises(InvalidRequestError) as info:
        core.add_request(req("huge", [1] * 50, max_tokens=30))
    assert "KV cache" in info.value.message
    assert not core.has_work()
    (done,) = core.run([req("fits", [1] * 40)])  # and the engine still serves what fits
    assert done.finish_reason == "length"


# --- priority classes ---------------------------------------------------------------------------


def _admission_order(core) -> list[str]:
    order = []
    while core.has_work():
        for r in core.scheduler.running:
            if r.request_id not in order:
                order.append(r.request_id)
        core.step()
    return order


def test_realtime_requests_start_before_queued_batch_requests():
    core = make_core(max_num_seqs=1)
    for i in range(6):
        core.add_request(req(f"b{i}", [i + 1] * 8, max_tokens=4, priority="batch"))
    core.step()  # b0 is running
    for i in range(3):
        core.add_request(req(f"r{i}", [i + 9] * 8, max_tokens=4, priority="realtime"))
    order = _admission_order(core)
    assert order[:4] == ["b0", "r0", "r1", "r2"]
    assert sorted(order[4:]) == ["b1", "b2", "b3", "b4", "b5"]


def test_batch_request_finishes_under_a_steady_realtime_stream():
    core = make_core(max_num_seqs=1)
    core.add_request(req("batch", [5] * 8, max_tokens=2, priority="batch"))
    finished = set()
    for i in range(40):  # keep realtime work always waiting
        core.add_request(req(f"r{i}", [7] * 8, max_tokens=2, priority="realtime"))
        for _ in range(2):
            finished |= {e.request_id for e in core.step() if e.finished}
        if "batch" in finished:
            break
    assert "batch" in finished
    # its weighted share (1 in 11 admissions, preempted again by the next realtime arrival), well before
    # the end of the stream
    assert len(finished) < 30


def test_aging_lets_a_starved_class_through():
    q = PriorityQueues(weights=(1e6, 1.0, 1e-6), aging_s=5.0)
    old = Request("old-batch", [1], SamplingParams(), max_tokens=1, stop_ids=frozenset(), priority="batch", arrival=0.0)
    q.add(old)
    for i in range(20):
        q.add(Request(f"rt{i}", [1], SamplingParams(), max_tokens=1, stop_ids=frozenset(), priority="realtime",
                      arrival=4.0 + i / 100))
    assert next(iter(q.in_admission_order(now=4.5))).request_id == "rt0"  # not aged yet: weights rule
    assert next(iter(q.in_admission_order(now=5.1))).request_id == "old-batch"  # aged: goes first


def test_stats_report_queue_depth_per_class():
    core = make_core(max_num_seqs=1)
    for cls, n in (("realtime", 1), ("standard", 2), ("batch", 3)):
        for i in range(n):
            core.add_request(req(f"{cls}{i}", [1, 2, 3], priority=cls))
    assert core.stats().requests.waiting_by_class == {"realtime": 1, "standard": 2, "batch": 3}
    core.step()
    s = core.stats()
    assert s.requests.running_by_class == {"realtime": 1, "standard": 0, "batch": 0}
    assert s.requests.waiting_by_class == {"realtime": 0, "standard": 2, "batch": 3}


# --- prefix caching -------------------------------------------------------------------------------

SYSTEM = list(range(1, 81))  # 5 full blocks of 16


def test_prefix_cache_pairs(tmp_path):
    core = make_core()
    path = make_peft_dir(tmp_path / "adapter", _loaded(MODEL).config, rank=8, alpha=16, targets="all", seed=3)
    core.add_adapter("ad", str(path))
    prompt = SYSTEM + [200, 201, 202]
    (first,) = core.run([req("1", prompt, salt="tenant-a")])
    (again,) = core.run([req("2", prompt, salt="tenant-a")])
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == 80 and again.token_ids == first.token_ids
    (other_salt,) = core.run([req("3", prompt, salt="tenant-b")])
    assert other_salt.usage.cached_tokens == 0 and other_salt.token_ids == first.token_ids
    (adapter_a,) = core.run([req("4", prompt, salt="tenant-a", adapter="ad")])
    assert adapter_a.usage.cached_tokens == 0
    (adapter_again,) = core.run([req("5", prompt, salt="tenant-a", adapter="ad")])
    assert adapter_again.usage.cached_tokens == 80 and adapter_again.token_ids == adapter_a.token_ids
    stats = core.stats()
    assert stats.kv.prefix_hit_tokens == 160 and stats.kv.prefix_cached_blocks > 0
    assert 0 < stats.kv.prefix_cache_hit_rate < 1


def test_shared_prefix_with_different_questions_reuses_only_the_prefix():
    core = make_core()
    core.run([req("warm", SYSTEM + [90, 91])])
    (done,) = core.run([req("q", SYSTEM + [92, 93, 94, 95])])
    assert done.usage.cached_tokens == 80
    want = make_core(enable_prefix_caching=False).run([req("q", SYSTEM + [92, 93, 94, 95])])[0].token_ids
    assert done.token_ids == want


def test_prefix_cache_can_be_switched_off():
    core = make_core(enable_prefix_caching=False)
    core.run([req("1", SYSTEM + [1])])
    (again,) = core.run([req("2", SYSTEM + [1])])
    assert again.usage.cached_tokens == 0 and core.stats().kv.prefix_cached_blocks == 0


def test_cached_blocks_are_evicted_lru_and_blocks_in_use_never():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    pool.register(a[0], b"h0")
    pool.register(a[1], b"h1")
    pool.free(a)  # cached, unreferenced: reusable, kept as long as possible
    assert pool.num_free == 4 and pool.lookup([b"h0", b"h1"]) == a
    pool.take([a[0]])  # a request reuses h0
    fresh = pool.allocate(3)  # takes the 2 uncached blocks, then evicts h1 (LRU among free cached)
    assert a[0] not in fresh and pool.lookup([b"h0"]) == [a[0]] and pool.lookup([b"h1"]) == []
    assert pool.evictions == 1
    with pytest.raises(RuntimeError):
        pool.allocate(1)  # the block in use is never taken


@pytest.mark.parametrize("chunk", [512, 32])
def test_a_prompt_arriving_several_times_at_once_is_computed_once(chunk):
    """The choices of an n > 1 request share their prompt: the followers wait for the first one's
    blocks and take them from the cache, whether its prefill takes one step or several chunks."""
    prompt = SYSTEM + [200, 201, 202]  # 5 full blocks and a partial one
    core = make_core(max_num_batched_tokens=chunk)
    reqs = [req(f"c{i}", prompt, max_tokens=8) for i in range(4)]
    for r in reqs:
        core.add_request(r)
    done: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while core.has_work():
        for ev in core.step():
            done.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finished:
                cached[ev.request_id] = ev.usage.cached_tokens
    assert cached == {"c0": 0, "c1": 80, "c2": 80, "c3": 80}
    assert core.stats().kv.prefix_hit_tokens == 240
    alone = make_core(enable_prefix_caching=False).run([req("a", prompt, max_tokens=8)])[0].token_ids
    assert all(tokens == alone for tokens in done.values())


def test_only_requests_sharing_the_block_in_prefill_wait():
    core = make_core()
    core.add_request(req("first", SYSTEM + [1, 2]))
    core.add_request(req("same", SYSTEM + [3]))  # shares all 5 blocks: waits one step
    core.add_request(req("other", [7] * 40))  # shares nothing: starts at once
    core.step()
    assert sorted(r.request_id for r in core.scheduler.running) == ["first", "other"]
    core.step()
    same = core.requests["same"]
    assert same in core.scheduler.running and same.num_cached == 80


def test_no_request_waits_for_a_prefix_when_the_cache_is_off():
    core = make_core(enable_prefix_caching=False)
    for i in range(3):
        core.add_request(req(f"c{i}", SYSTEM + [1]))
    core.step()
    assert len(core.scheduler.running) == 3


# --- aborts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["prefill", "decode", "swapped"])
def test_abort_returns_pools_to_baseline(where):
    mode = "swap" if where == "swapped" else "recompute"
    core = make_core(num_kv_blocks=14, max_num_batched_tokens=32, preemption_mode=mode)
    reqs = [req(f"r{i}", p, max_tokens=60) for i, p in enumerate(mixed_prompts(5, seed=11))]
    for r in reqs:
        core.add_request(r)
    target = None
    for _ in range(500):
        core.step()
        live = list(core.requests.values())
        if where == "prefill":
            target = next((r for r in live if 0 < r.num_computed < len(r.prompt_ids)), None)
        elif where == "decode":
            target = next((r for r in live if r.output_ids and r.blocks), None)
        else:
            target = next((r for r in live if r.swap_blocks), None)
        if target:
            break
    assert target is not None, f"never saw a request in {where}"
    core.abort(target.request_id)
    for r in list(core.requests):
        core.abort(r)
    stats = core.stats()
    assert stats.kv.blocks_used == 0 and stats.kv.swap_blocks_used == 0
    assert stats.requests.running == stats.requests.waiting == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_realtime_preempts_a_running_batch_request_which_still_ends_the_same(mode):
    batch_reqs = [req(f"b{i}", [i + 1] * 20, max_tokens=30, priority="batch") for i in range(2)]
    want = make_core().run(batch_reqs)
    core = make_core(max_num_seqs=2, preemption_mode=mode)
    got: dict[str, list[int]] = {}

    def step():
        for e in core.step():
            got.setdefault(e.request_id, []).extend(e.token_ids)

    for r in batch_reqs:
        core.add_request(r)
    for _ in range(5):
        step()
    core.add_request(req("rt", [9] * 20, max_tokens=3, priority="realtime"))
    step()
    assert "rt" in {r.request_id for r in core.scheduler.running}  # admitted at once
    assert core.stats().requests.preemptions_by_class["batch"] == 1
    while core.has_work():
        step()
    assert [got[w.request_id] for w in want] == [w.token_ids for w in want]
    assert len(got["rt"]) == 3
