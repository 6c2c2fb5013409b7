"""Log-probabilities of generated tokens (SamplingParams.logprobs): the model's own distribution at
each step, checked against a reference forward pass over the whole sequence, whatever sampling or a
schema's mask did to the choice."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.engine.api import GenerateRequest, InvalidRequestError, SamplingParams
from loraplex.engine.kv.block_pool import allocate_kv_tensors
from loraplex.engine.models.attention import build_metadata
from loraplex.engine.models.llama import LlamaModel
from tests.conftest import _loaded, make_core
from tests.unit.test_engine_core import MODEL, mixed_prompts


def reference_logprobs(prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: log_softmax of the logits that preceded each output token, from one
    forward pass of the whole sequence."""
    loaded = _loaded(MODEL)
    cfg = loaded.config
    model = LlamaModel(cfg, loaded.weights)
    ids = prompt + output[:-1]
    n = len(ids)
    blocks = list(range((n + 15) // 16))
    kv = allocate_kv_tensors(cfg.num_layers, len(blocks), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                             torch.device("cpu"))
    rows = torch.arange(len(prompt) - 1, n)
    with torch.inference_mode():
        logits = model.forward(torch.tensor(ids), torch.arange(n), build_metadata([(0, n, blocks)], 16, "cpu"), kv,
                               rows)
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
