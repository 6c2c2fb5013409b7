"""Per-request sampling: seeds, top-k/top-p, penalties, stop strings and stop tokens (engines and logits on
the test device, --device)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.api import GenerateRequest, InvalidRequestError, SamplingParams
from loraplex.engine.sampler import apply_penalties, greedy_tokens, sample
from loraplex.engine.sched.request import Request
from tests.conftest import make_core
from tests.unit.test_engine_core import MODEL, greedy, mixed_prompts


def sampled(rid: str, ids, seed: int | None, **kw) -> GenerateRequest:
    sp = SamplingParams(max_tokens=20, temperature=kw.pop("temperature", 1.0), seed=seed, ignore_eos=True, **kw)
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp)


def test_seeded_request_is_reproducible_whatever_shares_its_batch():
    prompt = [10, 20, 30, 40]
    alone = make_core().run([sampled("s", prompt, seed=1234)])[0].token_ids
    others = [sampled(f"o{i}", p, seed=None) for i, p in enumerate(mixed_prompts(7))]
    in_batch = make_core().run(others[:3] + [sampled("s", prompt, seed=1234)] + others[3:])
    assert in_batch[3].token_ids == alone
    other_seed = make_core().run([sampled("s", prompt, seed=99)])[0].token_ids
    assert other_seed != alone


def test_top_k_1_and_tiny_top_p_are_greedy():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = make_core().run([greedy("g", prompt, max_tokens=20)])[0].token_ids
    assert make_core().run([sampled("k", prompt, seed=5, top_k=1)])[0].token_ids == want
    assert make_core().run([sampled("p", prompt, seed=5, top_p=1e-6)])[0].token_ids == want


def test_a_vanishing_temperature_is_greedy_not_nan():
    """Found by the fuzzer: logits divided by 2e-95 overflowed to inf and the step failed."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = make_core().run([greedy("g", prompt, max_tokens=20)])[0].token_ids
    for t in (1.9867529510181955e-95, 5e-324, 1e-6):
        done = make_core().run([sampled("t", prompt, seed=None, temperature=t)])[0]
        assert done.finish_reason == "length" and done.token_ids == want, t


def test_stop_token_id_ends_with_stop():
    prompt = [5, 6, 7]
    free = make_core().run([greedy("f", prompt, max_tokens=20)])[0].token_ids
    stop_tok = free[6]
    first = free.index(stop_tok)
    (done,) = make_core().run([greedy("s", prompt, max_tokens=20, stop_token_ids=(stop_tok,))])
    assert done.finish_reason == "stop"
    assert done.token_ids == free[: first + 1]


def test_stop_string_is_cut_and_never_emitted():
    # Prompt bytes steer the tiny byte-level model; whatever it writes, we stop on a piece of it.
    prompt = list(b"hello world, hello world, hello")
    (free,) = make_core().run([greedy("f", prompt, max_tokens=30)])
    text = free.text
    assert len(text) >= 6
    stop = text[3:6]
    (done,) = make_core().run([greedy("s", prompt, max_tokens=30, stop=(stop,))])
    assert done.finish_reason == "stop"
    assert done.text == text[: text.index(stop)]
    assert stop not in done.text


def test_max_tokens_ends_with_length():
    (done,) = make_core().run([greedy("m", [1, 2, 3], max_tokens=7)])
    assert done.finish_reason == "length" and len(done.token_ids) == 7


def _req(**kw) -> Request:
    return Request("r", [1], SamplingParams(**kw), max_tokens=10, stop_ids=frozenset())


def test_penalties_follow_openai_formula(device):
    r = _req(presence_penalty=0.5, frequency_penalty=0.25)
    r.output_ids = [2, 2, 2, 3]
    logits = torch.zeros(1, 6, device=device)
    apply_penalties(logits, [r])
    assert logits[0].tolist() == [0.0, 0.0, -(0.75 + 0.5), -(0.25 + 0.5), 0.0, 0.0]


def test_greedy_and_top_k_sampling_pick_allowed_tokens(device):
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9], [0.0, 5.0, 1.0, 4.9]], device=device)
    g = _req(temperature=0.0)
    # a seeded draw is a function of (seed, position): 50 seeds give 50 independent draws
    picks = {sample(logits.clone(), [g, _req(temperature=1.0, top_k=2, seed=s)])[0][1] for s in range(50)}
    assert sample(logits[:1].clone(), [g])[0] == [1]
    assert picks == {1, 3}


def test_greedy_tokens_match_torch_argmax_on_every_path(device):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(32, 49152, generator=gen).to(device)
    logits[3, 100:] = logits[3].max()  # a tie: the first index of the maximum wins
    want = logits.argmax(-1).tolist()
    assert greedy_tokens(logits) == want  # on the CPU the C kernel (fp32, dense rows)
    assert greedy_tokens(logits.t().contiguous().t()) == want  # columns dense: torch's argmax
    assert greedy_tokens(logits.to(torch.bfloat16)) == logits.to(torch.bfloat16).argmax(-1).tolist()


def test_greedy_rows_of_a_mixed_batch_take_the_argmax(device):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)).to(device)
    reqs = [_req(temperature=0.0) if i % 2 else _req(temperature=1.0, seed=i) for i in range(4)]
    out, logprobs = sample(logits.clone(), reqs)
    assert logprobs == [None] * 4  # none asked
    assert [out[1], out[3]] == logits[[1, 3]].argmax(-1).tolist()
    assert all(0 <= t < 50 for t in out)


def test_logit_bias_bans_and_forces_tokens():
    prompt = [7, 8, 9]
    free = make_core().run([greedy("f", prompt, max_tokens=12)])[0].token_ids
    banned = free[0]
    without = make_core().run([greedy("b", prompt, max_tokens=12, logit_bias=((banned, -100.0),))])[0].token_ids
    assert banned not in without and without != free
    forced = make_core().run([sampled("s", prompt, seed=3, logit_bias=((65, 100.0),))])[0].token_ids
    assert forced == [65] * 20


@pytest.mark.parametrize(("bias", "says"), [
    (((1, 101.0),), "in [-100, 100]"), (((-1, 1.0),), ">= 0"), (((10**6, 1.0),), "outside the vocabulary")])
def test_bad_logit_bias_is_refused_naming_the_field(bias, says):
    with pytest.raises(InvalidRequestError) as info:
        make_core().add_request(greedy("x", [1, 2], logit_bias=bias))
    assert info.value.param == "logit_bias" and says in info.value.message


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_beyond_64_bits_is_refused_and_the_engine_serves_on(seed):
    core = make_core()
    with pytest.raises(InvalidRequestError) as info:
        core.add_request(sampled("x", [1, 2], seed=seed))
    assert info.value.param == "seed" and "64 bits" in info.value.message
    assert not core.has_work()
    (done,) = core.run([sampled("ok", [1, 2], seed=2**64 - 1)])  # the edges are valid seeds
    assert len(done.token_ids) == 20
