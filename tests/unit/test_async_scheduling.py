"""Asynchronous scheduling (EngineConfig.async_scheduling): step N+1 is scheduled and launched while step N is in
flight, its pending tokens fed from the device; the engine's tokens, finish reasons and usage stay those of the
one-step-at-a-time engine, and nothing leaks when a request ends or fails with a step in flight.

On the CPU the device is the host, so nothing overlaps in time; the order of the work is the same as on CUDA.
"""

from __future__ import annotations

import random

import pytest

from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from tests.conftest import _loaded, make_core
from tests.lora_factory import make_peft_dir

MODEL = "synthetic:tiny"
ENGINE = {"block_size": 4, "max_model_len": 160, "max_num_seqs": 6, "max_num_batched_tokens": 48,
          "speculative_tokens": 0}


def request(rid: str, ids: list[int], max_tokens: int, **sp) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, "ignore_eos": True, **sp})
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sampling)


def workload(stop_at: dict[str, int] | None = None, adapters: bool = False) -> list[tuple[int, GenerateRequest]]:
    """(arrival step, request): greedy and seeded sampled requests, log-probabilities, a scored prompt, a prefix
    hit, short and long outputs; `stop_at`: a stop token per request id."""
    rng = random.Random(11)
    stop_at = stop_at or {}
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    prompts[5] = prompts[0] + [7, 8]  # a prefix hit on r0's blocks
    kinds = [{}, {"temperature": 0.8, "seed": 5, "top_p": 0.9}, {"logprobs": 2}, {"temperature": 1.1, "seed": 9,
             "top_k": 20, "min_p": 0.01}, {"prompt_logprobs": 1}, {}, {"temperature": 0.7, "seed": 1}, {}]
    out = []
    for i, (p, kind) in enumerate(zip(prompts, kinds, strict=True)):
        rid = f"r{i}"
        sp = dict(kind)
        if rid in stop_at:
            sp["stop_token_ids"] = (stop_at[rid],)
        req = request(rid, p, 6 + (i * 7) % 23, **sp)
        if adapters and i % 3:
            req = GenerateRequest(rid, MODEL, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
                                  adapter=f"a{i % 2}")
        out.append((i // 2 * 3, req))
    return out


def run(arrivals, mode: str, adapter_dirs=(), **overrides):
    """Runs the arrivals on a fresh engine; returns (core, {request: (token ids, finish reason, usage)}, launches
    made while another step was in flight)."""
    core = make_core(MODEL, async_scheduling=mode, **{**ENGINE, **overrides})
    for i, path in enumerate(adapter_dirs):
        core.add_adapter(f"a{i}", str(path))
        core.pin_adapter(f"a{i}")
    launch, overlapped = core.runner.launch, []

    def counting_launch(batch, previous=None):
        overlapped.append(previous is not None)
        return launch(batch, previous)

    core.runner.launch = counting_launch
    pending, got, step = list(arrivals), {}, 0
    while pending or core.has_work():
        while pending and pending[0][0] <= step:
            core.add_request(pending.pop(0)[1])
        for ev in core.step():
            assert ev.error is None, ev.error
            tokens, _, _ = got.setdefault(ev.request_id, ([], None, None))
            tokens.extend(ev.token_ids)
            if ev.finished:
                got[ev.request_id] = (tokens, ev.finish_reason, (ev.usage.prompt_tokens, ev.usage.completion_tokens))
        step += 1
    assert core.stats().kv.blocks_used == 0 and not core.requests  # nothing held at the end
    return core, got, sum(overlapped)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    cfg = _loaded(MODEL).config
    root = tmp_path_factory.mktemp("async_adapters")
    return [make_peft_dir(root / f"a{i}", cfg, rank=4, alpha=8, targets="all", seed=60 + i, magnitude=0.2)
            for i in range(2)]


def stops_midway() -> dict[str, int]:
    """A stop token per request: a token its plain run emits halfway, so it ends while its next step is in flight."""
    _, got, _ = run(workload(), "off")
    return {rid: tokens[len(tokens) // 2] for rid, (tokens, _, _) in got.items() if len(tokens) > 3}


@pytest.mark.parametrize("pool", ["roomy", "recompute", "swap"])
def test_async_scheduling_gives_the_tokens_of_the_plain_engine(pool):
    """Stops that land while the next step runs, seeded sampling, log-probabilities, a prefix hit, chunked
    prefill and, with a tight pool, preemption by recompute or by swap with tokens in flight."""
    tight = {"roomy": {}, "recompute": {"num_kv_blocks": 22}, "swap": {"num_kv_blocks": 22, "preemption_mode": "swap"}}
    arrivals = workload(stops_midway())
    plain, want, none = run(arrivals, "off", **tight[pool])
    core, got, overlapped = run(arrivals, "on", **tight[pool])
    assert got == want
    assert none == 0 and overlapped > core.num_steps // 2  # most steps were launched behind another
    assert sum(1 for _, reason, _ in got.values() if reason == "stop") >= 3
    if pool != "roomy":
        assert core.scheduler.num_preemptions > 0
    if pool == "swap":
        assert core.kv.stats.swapped_out_blocks > 0 and core.stats().kv.swap_blocks_used == 0
    if pool == "roomy":  # (a tight pool evicts r0's blocks before r5 comes)
        assert core.kv.stats.prefix_hit_tokens > 0


def test_async_scheduling_with_adapters_and_static_decode(adapter_dirs):
    """Pending tokens fed into the static decode buffers (cuda_graphs on: eager on the CPU), with adapters."""
    arrivals = workload(adapters=True)[:5]  # (r1, r2 and r4 on adapters; the Triton interpreter is slow)
    extra = {"attention_backend": "triton_paged", "cuda_graphs": "on"}
    _, want, _ = run(arrivals, "off", adapter_dirs)
    core, got, overlapped = run(arrivals, "on", adapter_dirs, **extra)
    assert got == want
    assert overlapped > 0 and core.runner.static.steps > 0


def test_requests_that_need_their_token_on_the_host_drain_the_pipeline():
    """Penalties count the last token and drafts read the output: the next step waits for the step in flight."""
    arrivals = [(0, request("p", [5, 6, 7, 8], 12, frequency_penalty=1.5, presence_penalty=0.5)),
                (0, request("g", [9, 10, 11], 12))]
    _, want, _ = run(arrivals, "off")
    _, got, overlapped = run(arrivals, "on")
    assert got == want and overlapped == 0
    _, plain, _ = run(arrivals[1:], "off", speculative_tokens=3)
    _, got, overlapped = run(arrivals[1:], "on", speculative_tokens=3)
    assert got == plain and overlapped == 0  # (two requests: drafts may be made at every step)


def test_max_tokens_schedules_no_step_past_the_last_token():
    """A request whose pending token is its last gets no further step: its rows are its prompt and max_tokens - 1."""
    core = make_core(MODEL, async_scheduling="on", **ENGINE)
    core.add_request(request("r", [1, 2, 3], 5))
    rows = []
    launch = core.runner.launch
    core.runner.launch = lambda batch, previous=None: (rows.append(batch.num_tokens), launch(batch, previous))[1]
    tokens = [t for _ in range(10) for ev in core.step() for t in ev.token_ids]
    assert len(tokens) == 5 and sum(rows) == 3 + 4 and not core.has_work()


def test_abort_with_a_step_in_flight_frees_everything_and_bills_what_was_sent():
    core = make_core(MODEL, async_scheduling="on", **ENGINE)
    core.add_request(request("a", list(range(1, 30)), 40))
    core.add_request(request("b", list(range(40, 60)), 40))
    sent = {"a": 0, "b": 0}
    for _ in range(6):
        for ev in core.step():
            sent[ev.request_id] += len(ev.token_ids)
    assert core._in_flight is not None and sent["a"] > 0
    ended = core.abort("a")
    assert ended.usage.completion_tokens == sent["a"]  # its token in flight is not billed
    while core.has_work():
        for ev in core.step():
            assert ev.request_id == "b"  # the aborted request's in-flight token is dropped
            sent["b"] += len(ev.token_ids)
    assert sent["b"] == 40 and core.stats().kv.blocks_used == 0


def test_a_failed_launch_with_a_step_in_flight_leaks_nothing():
    core = make_core(MODEL, async_scheduling="on", **ENGINE)
    for i in range(3):
        core.add_request(request(f"r{i}", [i + 1] * 9, 30))
    launch, calls = core.runner.launch, []

    def failing(batch, previous=None):
        calls.append(previous is not None)
        if len(calls) == 5:
            raise RuntimeError("injected fault")
        return launch(batch, previous)

    core.runner.launch = failing
    with pytest.raises(RuntimeError, match="injected fault"):
        for _ in range(10):
            core.step()
    assert calls[-1] and core._in_flight is None  # it failed behind a step in flight, which was dropped
    for rid in list(core.requests):
        core.abort(rid)  # (what the model pool does after a failed step)
    stats = core.stats()
    assert stats.kv.blocks_used == 0 and stats.requests.running == 0 and not core.has_work()


def test_async_scheduling_setting():
    assert EngineConfig(model=MODEL, device="cpu").async_scheduling_on is False  # the CPU overlaps nothing
    assert EngineConfig(model=MODEL, device="cpu", async_scheduling="on").async_scheduling_on
    with pytest.raises(ValueError, match="async_scheduling must be auto, on or off"):
        EngineConfig(model=MODEL, async_scheduling="sometimes")
