"""Speculative decoding by n-gram lookup: the drafts it proposes, and an engine that verifies them
giving exactly the tokens (and log-probabilities) of one-token-at-a-time greedy decoding, in fewer
steps, with its KV blocks, prefix cache and preemption intact."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.sched.ngram import propose
from tests.conftest import make_core
from tests.unit.test_engine_core import MODEL, greedy


def test_propose_follows_the_last_earlier_occurrence_of_the_longest_suffix():
    assert propose([5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7], 3) == [8, 1, 6]  # "5 6 7" beats the later "6 7"
    assert propose([1, 6, 7, 9, 2, 3, 6, 7], 3) == [9, 2, 3]  # only "6 7" occurs earlier
    assert propose([6, 7, 1, 6, 7, 2, 4, 6, 7], 3) == [2, 4, 6]  # its last occurrence, not its first
    assert propose([1, 2, 3, 4], 4) == []  # no suffix of 2+ tokens occurs earlier
    assert propose([1, 2, 1, 2], 4) == [1, 2]  # only what follows exists
    assert propose([4, 4, 4, 4, 4], 3) == [4]
    assert propose([1, 2, 3, 1, 2], 0) == []


def test_propose_matches_whole_tokens_only():
    # 256 = 00 01 00 00 and 1 = 01 00 00 00: the byte pattern of [1, 0] appears inside [256, 0, ...]
    # at an odd offset, which is no token boundary
    tokens = [256, 0, 0, 9, 1, 0]
    assert propose(tokens, 2) == []
    assert propose([7, 1, 0, 3, 256, 1, 0], 2) == [3, 256]


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase of a few distinct tokens, as quoting and editing repeat their input,
    so that lookups find drafts for every request (the engine speculates beside other requests only
    when all of them have drafts)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(40, 48) for _ in range(rng.randrange(4, 9))]
        out.append((phrase * 8)[: rng.randrange(40, 70)])
    return out


def _run(core, reqs):
    done = core.run(reqs)
    return [(c.token_ids, c.finish_reason) for c in done]


@pytest.mark.parametrize("k", [1, 4, 7])
def test_drafts_give_the_tokens_of_one_token_at_a_time_in_fewer_steps(k):
    reqs = [greedy(f"r{i}", p, max_tokens=40) for i, p in enumerate(repetitive_prompts(4, seed=k))]
    plain = make_core(speculative_tokens=0)
    want = _run(plain, reqs)
    spec = make_core(speculative_tokens=k, speculative_max_seqs=4)
    assert _run(spec, reqs) == want
    stats = spec.stats()
    spec = stats.speculation
    assert spec.draft_tokens > 0 and 0 < spec.accepted_tokens <= spec.draft_tokens
    assert stats.requests.num_steps < plain.stats().requests.num_steps
    assert stats.requests.generated_tokens == plain.stats().requests.generated_tokens == 160
    assert stats.kv.blocks_used == 0


def test_only_small_batches_of_greedy_requests_speculate():
    prompts = repetitive_prompts(6, seed=3)
    sampled = [GenerateRequest(f"s{i}", MODEL, prompt_token_ids=tuple(p),
                               sampling=SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True))
               for i, p in enumerate(prompts[:2])]
    penalized = [greedy("p", prompts[2], max_tokens=20, frequency_penalty=0.5)]
    core = make_core(speculative_tokens=4, speculative_max_seqs=4)
    core.run(sampled + penalized)
    assert core.stats().speculation.draft_tokens == 0
    crowded = make_core(speculative_tokens=4, speculative_max_seqs=2)
    crowded.run([greedy(f"g{i}", p, max_tokens=20) for i, p in enumerate(prompts)])
    assert crowded.stats().speculation.draft_tokens == 0  # six running: above the limit every step
    default = make_core()  # on by default
    default.run([greedy("g", prompts[0], max_tokens=48)])
    assert default.stats().speculation.draft_tokens > 0


def test_no_request_speculates_beside_one_without_drafts():
    """A batch takes as many steps as its slowest request: while one has nothing to guess, guesses
    for the others would only add rows, so nobody speculates until it leaves."""
    fresh = list(range(100, 160))  # no token repeats: no suffix occurs earlier
    core = make_core(speculative_tokens=4, speculative_max_seqs=4)
    core.add_request(greedy("quote", repetitive_prompts(1, seed=2)[0], max_tokens=30))
    core.add_request(GenerateRequest("fresh", MODEL, prompt_token_ids=tuple(fresh), sampling=SamplingParams(
        max_tokens=3, temperature=0.7, seed=1, ignore_eos=True)))  # sampled: it never has drafts
    while "fresh" in core.requests:
        core.step()
        assert core.stats().speculation.draft_tokens == 0
    while core.has_work():
        core.step()
    assert core.stats().speculation.draft_tokens > 0  # alone, the quoting request speculates


def test_logprobs_stop_tokens_and_max_tokens_are_those_of_plain_decoding():
    prompt = repetitive_prompts(1, seed=5)[0]
    plain = make_core(speculative_tokens=0).run([greedy("a", prompt, max_tokens=30, logprobs=2)])[0]
    stop = plain.token_ids[17]  # a token the output reaches: the request must end exactly there
    kinds = [greedy("lp", prompt, max_tokens=30, logprobs=2),
             GenerateRequest("stop", MODEL, prompt_token_ids=tuple(prompt), sampling=SamplingParams(
                 max_tokens=30, temperature=0.0, stop_token_ids=(stop,))),
             greedy("short", prompt, max_tokens=5)]
    want = make_core(speculative_tokens=0)
    got = make_core(speculative_tokens=6)
    for req in kinds:
        (a,) = want.run([req])
        events = []
        got.add_request(req)
        while got.has_work():
            events += got.step()
        assert [t for e in events for t in e.token_ids] == a.token_ids
        assert events[-1].finish_reason == a.finish_reason
        if req.sampling.logprobs is not None:
            ref = [e for ev in _events(want, req) for e in ev.logprobs]
            mine = [e for ev in events for e in ev.logprobs]
            assert [e.token_id for e in mine] == [e.token_id for e in ref]
            assert all(abs(x.logprob - y.logprob) < 1e-4 and [t for t, _, _ in x.top] == [t for t, _, _ in y.top]
                       for x, y in zip(mine, ref, strict=True))
    assert got.stats().speculation.accepted_tokens > 0


def _events(core, req):
    core.add_request(req)
    events = []
    while core.has_work():
        events += core.step()
    return events


def test_the_prefix_cache_holds_only_accepted_tokens():
    """Blocks filled by kept drafts are cached under their tokens; a follow-up prompt that extends the
    whole conversation hits them and continues exactly as without speculation."""
    prompt = repetitive_prompts(1, seed=8)[0]
    spec, plain = make_core(speculative_tokens=4), make_core(speculative_tokens=0)
    (first,) = spec.run([greedy("1", prompt, max_tokens=48)])
    assert first.token_ids == plain.run([greedy("1", prompt, max_tokens=48)])[0].token_ids
    follow = prompt + first.token_ids + [3, 4, 5]
    (again,) = spec.run([greedy("2", follow, max_tokens=16)])
    # every block the first request filled (all but its last token was computed) is a hit
    assert again.usage.cached_tokens == (len(prompt) + 47) // 16 * 16
    assert again.token_ids == plain.run([greedy("2", follow, max_tokens=16)])[0].token_ids


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_speculation_still_gives_the_same_tokens(mode):
    reqs = [greedy(f"r{i}", p, max_tokens=40) for i, p in enumerate(repetitive_prompts(4, seed=11))]
    want = _run(make_core(speculative_tokens=0), reqs)
    tight = make_core(num_kv_blocks=12, preemption_mode=mode, speculative_tokens=4, speculative_max_seqs=4)
    assert _run(tight, reqs) == want
    stats = tight.stats()
    assert sum(stats.requests.preemptions_by_class.values()) > 0 and stats.speculation.accepted_tokens > 0
    assert stats.kv.blocks_used == 0 and stats.kv.swap_blocks_used == 0


def test_adapter_requests_speculate_and_keep_their_tokens(tmp_path):
    from tests.conftest import _loaded
    from tests.lora_factory import make_peft_dir

    config = _loaded(MODEL).config
    paths = [make_peft_dir(tmp_path / f"a{i}", config, rank=8, alpha=16, targets="all", seed=i + 1) for i in range(2)]
    prompts = repetitive_prompts(3, seed=13)
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(f"r{i}", MODEL, prompt_token_ids=tuple(p), adapter=adapter, sampling=sp)
            for i, (p, adapter) in enumerate(zip(prompts, ["a0", "a1", None], strict=True))]
    cores = {k: make_core(speculative_tokens=k, speculative_max_seqs=4) for k in (0, 4)}
    for core in cores.values():
        for i, path in enumerate(paths):
            core.add_adapter(f"a{i}", str(path))
    assert _run(cores[4], reqs) == _run(cores[0], reqs)
    assert cores[4].stats().speculation.accepted_tokens > 0


@pytest.mark.parametrize("path", [pytest.param("fused", marks=pytest.mark.cpu_kernels),
                                  pytest.param("per_op", marks=pytest.mark.cpu_kernels), "torch_sdpa", "triton_paged"])
def test_a_sequences_new_tokens_as_decode_rows_see_exactly_the_tokens_before_them(path, monkeypatch, device):
    """Drafts after a context are decode rows, each with its own length: their logits equal those of
    decoding the same tokens one at a time, on the test device (fused C step and per-op C attention on
    the CPU; torch SDPA; Triton paged attention, on the CPU in the interpreter)."""
    import torch

    from loraplex.engine.attention.triton_paged import PagedMetadata
    from loraplex.engine.kv.block_pool import allocate_kv_storage, layer_views
    from loraplex.engine.models.layer_ops import CpuKernelOps
    from loraplex.engine.models.llama import LlamaModel
    from loraplex.engine.models.synthetic import synthetic_model

    config, weights, _ = synthetic_model("tiny")
    dtype = torch.float32
    model = LlamaModel(config, {name: w.to(device, dtype) for name, w in weights.items()},
                       attention="cpu_c" if path in ("fused", "per_op") else path)
    if path in ("fused", "per_op"):
        assert isinstance(model.ops, CpuKernelOps) and model.attention.fused_decode_step
    if path == "per_op":
        monkeypatch.setattr(model.ops, "decode_step", None)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (35,), generator=g).to(device)
    blocks = [1, 2, 3]

    def positions(*span: int) -> torch.Tensor:
        return torch.arange(*span, device=device)

    def metadata(computed: int, new: int):
        return model.attention.build_metadata([(computed, new, blocks)], 16, device, dtype)

    def cache():
        storage = allocate_kv_storage(config.num_layers, 4, 16, config.num_kv_heads, config.head_dim, dtype, device)
        model.forward(ids[:30], positions(30), metadata(0, 30), layer_views(storage), positions(29, 30))
        return layer_views(storage)

    one_by_one, kv = [], cache()
    for p in range(30, 35):
        one_by_one.append(model.forward(ids[p:p + 1], positions(p, p + 1), metadata(p, 1), kv, positions(1))[0])
    meta = metadata(30, 5)
    lens = meta.lens if isinstance(meta, PagedMetadata) else meta.decode_lens
    assert meta.decode_all and lens.tolist() == [31, 32, 33, 34, 35]
    together = model.forward(ids[30:35], positions(30, 35), meta, cache(), positions(5))
    torch.testing.assert_close(together, torch.stack(one_by_one), rtol=1e-5, atol=1e-5)
    assert not metadata(30, 9).decode_all  # more new tokens than decode rows take: a prefill chunk


def test_sampled_drafts_leave_every_token_distributed_as_plain_sampling(device):
    """Speculative sampling with deterministic drafts: the first token is distributed as the first
    row's p, and the second, given the first draft was emitted, as the second row's."""
    import torch

    from loraplex.engine.sampler import sample_steps
    from loraplex.engine.sched.request import Request

    vocab, drafts, n = 6, [2, 4], 20000
    logits = torch.tensor([[1.0, 0.5, 1.5, 0.0, -1.0, 0.2],  # after the last token: draft 2 is likely
                           [0.3, 0.1, 0.0, 0.2, 0.1, -0.5],  # after draft 2: draft 4 is not favoured
                           [0.0, 2.0, 0.0, 0.0, 0.0, 0.0]], device=device)  # after draft 4
    sp = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for i in range(n):
        r = Request(f"r{i}", [1], sp, max_tokens=8, stop_ids=frozenset())
        r.generator.manual_seed(i)
        r.spec_ids = list(drafts)
        (tokens,), _, (rejected,) = sample_steps(logits.clone(), [r])
        assert 1 <= len(tokens) <= 3 and rejected == 3 - len(tokens)
        assert tokens[:-1] == drafts[:len(tokens) - 1]  # only drafts are kept, in order
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1

    def target(row):
        from loraplex.engine.sampler import _filter_top_k_top_p
        return _filter_top_k_top_p(logits[row] / sp.temperature, sp.top_k, sp.top_p).softmax(-1).cpu()

    assert (first / n - target(0)).abs().max() < 0.012
    assert (second / second.sum() - target(1)).abs().max() < 0.015


def test_unseeded_sampled_requests_speculate_and_seeded_ones_do_not():
    prompt = repetitive_prompts(1, seed=2)[0]
    unseeded = GenerateRequest("u", MODEL, prompt_token_ids=tuple(prompt), sampling=SamplingParams(
        max_tokens=48, temperature=0.05, ignore_eos=True))  # near-greedy: its output repeats itself
    seeded = GenerateRequest("s", MODEL, prompt_token_ids=tuple(prompt), sampling=SamplingParams(
        max_tokens=48, temperature=0.05, seed=5, ignore_eos=True))
    core = make_core()
    req = core.prepare(unseeded)
    req.generator.manual_seed(7)  # its draws drawn from a known state, so the test is deterministic
    core.add(req)
    generated = 0
    while core.has_work():
        generated += sum(len(ev.token_ids) for ev in core.step())
    assert generated == 48 and core.stats().speculation.draft_tokens > 0
    core = make_core()
    (alone,) = core.run([seeded])
    assert core.stats().speculation.draft_tokens == 0
    assert alone.token_ids == make_core(speculative_tokens=0).run([seeded])[0].token_ids
