"""The batched device sampler (sampler.py over sampling_ops.py): seeded draws that do not depend on the
batch, filters and logit changes distributed exactly as their definitions say, greedy and guided rows, and
one host copy per step. Logits on the test device (--device)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from loraplex.engine import sampling_ops as ops
from loraplex.engine.api import GenerateRequest, InvalidRequestError, SamplingParams
from loraplex.engine.sampler import sample, token_logprobs
from loraplex.engine.sched.request import Request
from tests.conftest import make_core, test_device
from tests.unit.test_engine_core import MODEL, mixed_prompts

VOCAB = 64


def req(rid: str = "r", output: tuple[int, ...] = (), **kw) -> Request:
    r = Request(rid, [1], SamplingParams(**kw), max_tokens=1000, stop_ids=frozenset())
    r.output_ids = list(output)
    return r


def row_logits(who: int, position: int) -> torch.Tensor:
    """[VOCAB] logits that depend only on (who, position): what a model would give that request there."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 * who + position)) * 2


def target_requests() -> list[Request]:
    """Two seeded requests, one with every filter and penalties, one with a logit bias and no filter."""
    return [req("a", temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, presence_penalty=0.3, seed=1234),
            req("b", temperature=1.2, logit_bias=((5, 1.5), (9, -100.0)), frequency_penalty=0.2, seed=2**64 - 7)]


def neighbours(kind: int) -> list[Request]:
    """Batches of other compositions: greedy, unseeded, other seeds, logprobs, penalties, every filter."""
    if kind == 0:
        return []
    if kind == 1:
        return [req("g", temperature=0.0), req("u", temperature=1.0)]
    if kind == 2:
        return [req("p", temperature=0.7, top_p=0.5), req("s", temperature=1.0, min_p=0.3, seed=99),
                req("gl", temperature=0.0, logprobs=3, logit_bias=((3, 2.0),)),
                req("f", temperature=1.1, frequency_penalty=1.0, presence_penalty=-0.5, output=(1, 1, 4))]
    return [req(f"k{i}", temperature=0.5 + i / 10, top_k=i % 7, seed=i if i % 2 else None) for i in range(21)]


def run_steps(kind: int, steps: int = 16) -> list[list[int]]:
    """The two targets' tokens over `steps` steps, placed among `kind`'s neighbours (each step's logits per
    request depend only on the request and its position, as a batch-invariant model's would)."""
    targets, others = target_requests(), neighbours(kind)
    batch = others[:len(others) // 2] + [targets[0]] + others[len(others) // 2:] + [targets[1]]
    if kind == 3:
        batch.reverse()
    for _ in range(steps):
        logits = torch.stack([row_logits(["a", "b"].index(r.request_id) if r in targets else 7 + batch.index(r),
                                         len(r.output_ids)) for r in batch]).to(test_device())
        tokens, _ = sample(logits, batch)
        for r, t in zip(batch, tokens, strict=True):
            r.output_ids.append(t)
    return [r.output_ids for r in targets]


def test_seeded_draws_are_the_same_alone_and_in_batches_of_other_compositions():
    alone = run_steps(0)
    for kind in (1, 2, 3):
        assert run_steps(kind) == alone, kind
    assert len(set(alone[0])) > 3 and len(set(alone[1])) > 3  # draws, not a constant
    assert 9 not in alone[1]  # its bias bans token 9


def test_seed_and_position_both_change_the_draw(device):
    logits = torch.zeros(200, VOCAB, device=device)  # uniform: any token may come
    by_seed, _ = sample(logits.clone(), [req(f"s{i}", seed=i) for i in range(200)])
    by_position, _ = sample(logits.clone(), [req(f"p{i}", seed=5, output=(0,) * i) for i in range(200)])
    assert len(set(by_seed)) > 40 and len(set(by_position)) > 40
    again, _ = sample(logits.clone(), [req(f"s{i}", seed=i) for i in range(200)])
    assert again == by_seed


def expected_distribution(logits: torch.Tensor, sp: SamplingParams, output: tuple[int, ...]) -> torch.Tensor:
    """The exact distribution the definitions give, in fp64: bias, penalties, temperature, then top-k (ties
    kept), top-p (a token goes when those above it already reach top_p), min-p (against the most likely)."""
    x = logits.double().cpu().clone()
    for t, b in sp.logit_bias:
        x[t] += b
    for t, c in Counter(output).items():
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty
    x /= sp.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if sp.top_k:
        keep &= x >= torch.sort(x, descending=True).values[sp.top_k - 1]
    p = torch.where(keep, x.softmax(-1), 0.0)
    if sp.top_p < 1:
        q, order = torch.sort(p / p.sum(), descending=True)
        keep[order[q.cumsum(-1) - q >= sp.top_p]] = False
        p = torch.where(keep, p, 0.0)
    if sp.min_p:
        p = torch.where(p >= sp.min_p * p.max(), p, 0.0)
    return p / p.sum()


CASES = [  # (sampling, output ids so far)
    (dict(temperature=0.7, top_k=3), ()),
    (dict(temperature=1.3, top_p=0.8), ()),
    (dict(temperature=1.0, min_p=0.2), ()),
    (dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.1), ()),
    (dict(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.4), (2, 2, 2, 6, 0)),
    (dict(temperature=1.0, logit_bias=((1, 1.5), (4, -100.0), (7, 0.7))), ()),
    (dict(temperature=1.0), ()),  # the rows with no filter, beside rows with every filter
]


@pytest.mark.parametrize("seeded", [True, False])
def test_filters_penalties_and_bias_give_their_exact_distribution(seeded, device):
    """Every case in one batch of many rows (so neutral values of one row's filters meet another's), each
    row a fresh request: each case's frequencies within 5 sigma of its exact distribution, and tokens
    of probability 0 never drawn."""
    logits = torch.tensor([1.2, 0.3, 0.9, -0.4, 1.6, 0.0, 0.6, -1.0])  # [8]
    n = 5000
    reqs = [req(f"r{i}", output=CASES[i % len(CASES)][1], seed=i if seeded else None, **CASES[i % len(CASES)][0])
            for i in range(n * len(CASES))]
    tokens, _ = sample(logits.expand(len(reqs), -1).contiguous().to(device), reqs)
    drawn = torch.tensor(tokens).view(n, len(CASES))
    for c, (kw, output) in enumerate(CASES):
        want = expected_distribution(logits, SamplingParams(**kw), output)
        freq = torch.bincount(drawn[:, c], minlength=8).double() / n
        never = want < 1e-12  # a -100 bias leaves 1e-44
        assert (freq[never] == 0).all(), kw
        sigma = (want * (1 - want) / n).sqrt()
        assert ((freq - want).abs() <= 5 * sigma + 1e-12).all(), (kw, freq, want)
        if kw.keys() & {"top_k", "top_p", "min_p", "logit_bias"}:
            assert never.any(), kw  # each filter case drops tokens the others keep


def test_greedy_rows_take_the_argmax_after_bias_and_penalties(device):
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(4)).to(device)
    reqs = [req("g0", temperature=0.0), req("s1", seed=1), req("g2", temperature=0.0, logit_bias=((11, 100.0),)),
            req("s3", top_k=2, seed=3), req("g4", temperature=0.0, output=(int(logits[4].argmax()),) * 3,
                                             presence_penalty=2.0, frequency_penalty=2.0), req("u5")]
    tokens, _ = sample(logits.clone(), reqs)
    penalized = logits[4].clone()
    penalized[int(logits[4].argmax())] -= 8.0
    assert [tokens[0], tokens[2], tokens[4]] == [int(logits[0].argmax()), 11, int(penalized.argmax())]
    assert tokens[3] in torch.topk(logits[3], 2).indices.tolist()


class FakeGuide:
    """A guide whose schema allows a fixed set of tokens (the sampler's view of engine/guided/guide.py)."""

    def __init__(self, allowed: list[int], ahead: bool = False):
        self.allowed = set(allowed)
        self.bias = np.full(VOCAB, -np.inf, dtype=np.float32)
        self.bias[allowed] = 0.0
        self.ahead = ahead
        self.masks = 0

    def mask(self) -> np.ndarray:
        self.masks += 1
        return self.bias

    def allows(self, token_id: int) -> bool:
        return token_id in self.allowed


def test_guided_rows_draw_only_allowed_tokens_and_greedy_ones_their_best_allowed(device):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(8)).to(device)
    best = int(logits[0].argmax())
    allowed = [t for t in range(VOCAB) if t % 5 == 1 and t != best]
    reqs = []
    for i in range(400):
        r = req(f"r{i}", temperature=0.0 if i % 4 == 0 else 1.5, top_k=10 if i % 4 == 2 else 0, seed=i)
        r.guide = FakeGuide(allowed, ahead=i % 8 == 4)
        reqs.append(r)
    tokens, _ = sample(logits.expand(len(reqs), -1).contiguous(), reqs)
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 5
    best_allowed = max(allowed, key=lambda t: float(logits[0, t]))
    assert {tokens[i] for i in range(0, 400, 4)} == {best_allowed}
    # a greedy row whose best token the schema allows picks it without filling its mask (on the CPU)
    free = req("free", temperature=0.0)
    free.guide = FakeGuide([best, *allowed])
    assert sample(logits.clone(), [free])[0] == [best]
    assert free.guide.masks == (0 if logits.device.type == "cpu" else 1)


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every way a tensor's values reach Python (each is a device-to-host copy off the CPU)."""
    calls: list[str] = []
    for name in ("tolist", "item", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_one_host_copy_per_step_with_tokens_and_logprobs(host_reads, device):
    """Greedy, sampled, seeded and unseeded rows with every filter, penalties, bias and logprobs: one copy.
    (Guided rows are left out: on the CPU their masks are added through numpy views, no copy either.)"""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2)).to(device)
    reqs = [req("g", temperature=0.0, logprobs=2), req("s", top_k=5, top_p=0.8, min_p=0.05, seed=3, logprobs=0),
            req("u", presence_penalty=0.5, output=(1, 2, 2)), req("b", logit_bias=((4, 3.0),), seed=9),
            req("gb", temperature=0.0, frequency_penalty=1.0, output=(7,)), req("l", logprobs=5, seed=1)]
    host_reads.clear()
    tokens, logprobs = sample(logits.clone(), reqs)
    assert host_reads == ["tolist"]
    assert [lp is None for lp in logprobs] == [False, False, True, True, True, False]
    assert [len(lp[1]) for lp in logprobs if lp is not None] == [2, 0, 5]
    host_reads.clear()
    again = token_logprobs(logits[[0, 1, 5]], [tokens[0], tokens[1], tokens[5]], [2, 0, 5])
    assert host_reads == ["tolist"]
    assert again == [logprobs[0], logprobs[1], logprobs[5]]  # the model's own distribution, before any change
    lp = logits[5].log_softmax(-1)
    assert again[2][0] == pytest.approx(float(lp[tokens[5]]), abs=1e-6)
    assert [t for t, _ in again[2][1]] == torch.topk(lp, 5).indices.tolist()


@pytest.mark.parametrize("min_p", [-0.1, 1.5, float("nan")])
def test_min_p_outside_0_1_is_refused_naming_the_field(min_p):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(min_p=min_p).validate()
    assert info.value.param == "min_p"


def test_a_seeded_engine_request_keeps_its_tokens_beside_other_compositions():
    def seeded(rid: str, **kw) -> GenerateRequest:
        sp = SamplingParams(max_tokens=16, ignore_eos=True, **kw)
        return GenerateRequest(rid, MODEL, prompt_token_ids=(10, 20, 30, 40), sampling=sp)
    target = seeded("t", temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, seed=77)
    alone = make_core().run([target])[0].token_ids
    prompts = mixed_prompts(4, seed=3)
    others = [GenerateRequest(f"o{i}", MODEL, prompt_token_ids=tuple(p), sampling=SamplingParams(
        max_tokens=12, ignore_eos=True, temperature=(0.0, 1.0, 0.6, 1.4)[i], seed=(None, 5, None, 6)[i],
        presence_penalty=0.5 * (i % 2), logprobs=i if i % 2 else None)) for i, p in enumerate(prompts)]
    for batch in (others[:2] + [target], [target] + others[2:], others[1:3] + [target] + others[3:]):
        done = make_core().run(batch)
        assert done[batch.index(target)].token_ids == alone


def test_rows_without_a_filter_keep_every_token_beside_rows_with_one(device):
    """Neutral values drop nothing, even where fp32's cumulative probability reaches 1 before the tail."""
    x = torch.zeros(2, 1000, device=device)
    x[:, 0] = 30.0  # the rest have probability e^-30 each: the sum is 1.0 in fp32 after the first token
    out = ops.filter_logits(x, None, torch.tensor([1.0, 0.5], device=device), None)
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).sum() == 1
