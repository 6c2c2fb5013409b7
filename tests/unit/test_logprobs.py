"""Log-probabilities of generated tokens (SamplingParams.logprobs): the model's own distribution at
each step, checked against a reference forward pass over the whole sequence, whatever sampling or a
schema's mask did to the choice. Engines and the reference run on the test device (--device)."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.engine.api import GenerateRequest, InvalidRequestError, SamplingParams
from loraplex.engine.kv.block_pool import allocate_kv_tensors
from loraplex.engine.models.llama import LlamaModel
from tests.conftest import _loaded, make_core
from tests.unit.test_engine_core import MODEL, mixed_prompts


def reference_logprobs(prompt: list[int], output: list[int], first_row: int | None = None) -> torch.Tensor:
    """[rows, vocab]: log_softmax of the logits that preceded each output token (or, from `first_row`
    on, each later token of the sequence), from one forward pass of the whole sequence (on the test
    device, through the model's attention backend)."""
    loaded = _loaded(MODEL)
    cfg = loaded.config
    model = LlamaModel(cfg, loaded.weights)
    device = model.device
    ids = prompt + output[:-1]
    n = len(ids)
    blocks = list(range((n + 15) // 16))
    kv = allocate_kv_tensors(cfg.num_layers, len(blocks), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
    rows = torch.arange(len(prompt) - 1 if first_row is None else first_row, n, device=device)
    meta = model.attention.build_metadata([(0, n, blocks)], 16, device, torch.float32)
    with torch.inference_mode():
        logits = model.forward(torch.tensor(ids, device=device), torch.arange(n, device=device), meta, kv, rows)
    return logits.float().log_softmax(-1)


def request(rid: str, ids, k: int | None, **sampling) -> GenerateRequest:
    sp = SamplingParams(max_tokens=sampling.pop("max_tokens", 12), logprobs=k, **sampling)
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp)


def events_of(core, reqs):
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    while core.has_work():
        for ev in core.step():
            out[ev.request_id].append(ev)
    return out


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 1.3, "seed": 4, "top_k": 20},  # the choice comes from a changed distribution
    {"temperature": 0.0, "presence_penalty": 2.0, "frequency_penalty": 2.0},
    {"temperature": 0.8, "seed": 1, "json_schema": json.dumps({"type": "object"})},  # and from a masked one
])
def test_logprobs_are_the_models_distribution_whatever_chose_the_token(sampling):
    prompt = mixed_prompts(1, seed=9)[0]
    events = events_of(make_core(), [request("r", prompt, 4, **sampling)])["r"]
    entries = [e for ev in events for e in ev.logprobs]
    output = [t for ev in events for t in ev.token_ids]
    assert [e.token_id for e in entries] == output
    ref = reference_logprobs(prompt, output)
    token_bytes = make_core().token_bytes
    for step, e in enumerate(entries):
        assert e.logprob == pytest.approx(ref[step, e.token_id].item(), abs=1e-4)
        want = torch.topk(ref[step], 4)
        assert [i for i, _, _ in e.top] == want.indices.tolist()
        assert [lp for _, _, lp in e.top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert e.token == token_bytes[e.token_id] and all(b == token_bytes[i] for i, b, _ in e.top)
    if sampling["temperature"] == 0.0 and "presence_penalty" not in sampling:
        assert all(e.token_id == e.top[0][0] for e in entries)  # greedy takes the most likely


def test_only_requests_that_ask_get_logprobs_and_k_zero_gives_the_chosen_token_alone():
    prompts = mixed_prompts(3, seed=2)
    reqs = [request("none", prompts[0], None, temperature=0.0), request("zero", prompts[1], 0, temperature=0.0),
            request("five", prompts[2], 5, temperature=0.0)]
    events = events_of(make_core(), reqs)
    assert all(not ev.logprobs for ev in events["none"])
    zero = [e for ev in events["zero"] for e in ev.logprobs]
    assert len(zero) == 12 and all(e.top == () and e.logprob <= 0 for e in zero)
    five = [e for ev in events["five"] for e in ev.logprobs]
    assert all(len(e.top) == 5 and [lp for *_, lp in e.top] == sorted((lp for *_, lp in e.top), reverse=True)
               for e in five)
    alone = events_of(make_core(), [request("none", prompts[0], None, temperature=0.0)])["none"]
    assert [ev.token_ids for ev in alone] == [ev.token_ids for ev in events["none"]]


@pytest.mark.parametrize("k", [-1, 21])
def test_out_of_range_counts_are_refused(k):
    with pytest.raises(InvalidRequestError, match=r"logprobs must be in \[0, 20\]") as info:
        make_core().add_request(request("bad", [1, 2], k))
    assert info.value.param == "logprobs"


def prompt_entries(core, req):
    events = events_of(core, [req])[req.request_id]
    assert all(not ev.prompt_logprobs for ev in events[1:])
    return events[0].prompt_logprobs


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16}])  # whole, and chunked prefill
def test_prompt_logprobs_cover_every_prompt_token(overrides):
    prompt = mixed_prompts(1, seed=13)[0][:90]
    entries = prompt_entries(make_core(**overrides), request("p", prompt, None, temperature=0.0, max_tokens=2,
                                                             prompt_logprobs=3))
    assert [e.token_id for e in entries] == prompt
    assert entries[0].logprob is None and entries[0].top == ()
    ref = reference_logprobs(prompt, [0], first_row=0)  # row p predicts token p + 1
    for p, e in enumerate(entries[1:]):
        assert e.logprob == pytest.approx(ref[p, e.token_id].item(), abs=1e-4)
        assert [i for i, _, _ in e.top] == torch.topk(ref[p], 3).indices.tolist()


def test_max_tokens_0_scores_the_prompt_and_generates_nothing():
    prompt = mixed_prompts(1, seed=21)[0][:40]
    core = make_core()
    want = prompt_entries(core, request("one", prompt, None, temperature=0.0, max_tokens=1, prompt_logprobs=2))
    (event,) = events_of(core, [request("zero", prompt, None, temperature=0.0, max_tokens=0, prompt_logprobs=2)])[
        "zero"]
    assert event.finish_reason == "length" and event.token_ids == () and event.text == ""
    assert event.usage.completion_tokens == 0 and event.usage.prompt_tokens == len(prompt)
    assert [(e.token_id, e.logprob) for e in event.prompt_logprobs] == [(e.token_id, e.logprob) for e in want]
    assert core.stats().kv.blocks_used == 0


def test_prompt_logprobs_bypass_the_prefix_cache_and_survive_preemption():
    prompts = mixed_prompts(6, seed=4)
    core = make_core()
    plain = request("warm", prompts[0], None, temperature=0.0, max_tokens=2)
    events_of(core, [plain])  # the prompt's blocks are now in the prefix cache
    again = events_of(core, [request("again", prompts[0], None, temperature=0.0, max_tokens=2)])["again"]
    assert again[-1].usage.cached_tokens > 0
    asked = events_of(core, [request("lp", prompts[0], None, temperature=0.0, max_tokens=2, prompt_logprobs=0)])["lp"]
    assert asked[-1].usage.cached_tokens == 0 and len(asked[0].prompt_logprobs) == len(prompts[0])
    reqs = [request(f"r{i}", p, None, temperature=0.0, max_tokens=40, prompt_logprobs=1) for i, p in enumerate(prompts)]
    roomy = events_of(make_core(enable_prefix_caching=False), reqs)
    tight = make_core(num_kv_blocks=14, preemption_mode="recompute")
    squeezed = events_of(tight, reqs)
    assert sum(tight.stats().requests.preemptions_by_class.values()) > 0
    for r in reqs:
        assert squeezed[r.request_id][0].prompt_logprobs == roomy[r.request_id][0].prompt_logprobs


def test_a_stop_token_gets_no_entry():
    prompt = mixed_prompts(1, seed=21)[0]
    free = [t for ev in events_of(make_core(), [request("f", prompt, 1, temperature=0.0)])["f"] for t in ev.token_ids]
    stop = free[2]
    events = events_of(make_core(), [request("s", prompt, 1, temperature=0.0, stop_token_ids=(stop,))])["s"]
    ids = [t for ev in events for t in ev.token_ids]
    entries = [e.token_id for ev in events for e in ev.logprobs]
    assert ids == free[:free.index(stop) + 1] and entries == ids[:-1]
