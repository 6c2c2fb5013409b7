"""The static decode path (engine/static_decode.py) against the dynamic one: the same tokens, and padded rows
that touch nothing but the scratch block.

cuda_graphs="on" with the triton_paged backend: on the CPU the static step runs eagerly (under Triton's
interpreter), on CUDA (--device) it is captured and replayed as CUDA graphs; "off" is the dynamic path.
"""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.cli.engine_args import add_engine_args
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.kernels.paged_attention import paged_decode_attention
from loraplex.engine.static_decode import buckets_for, static_decode_mode
from tests.conftest import _loaded, make_core
from tests.kernels.test_paged_attention import make_case, new_out, run_decode
from tests.lora_factory import make_peft_dir
from tests.unit.test_speculative import repetitive_prompts

MODEL = "synthetic:tiny"
# 8 requests x (1 + 2 drafts) = 24 rows at most: buckets 1 .. 32; contexts under 512 keep one split in both paths
ENGINE = {"attention_backend": "triton_paged", "max_model_len": 128, "block_size": 4, "max_num_seqs": 8,
          "speculative_tokens": 2, "speculative_max_seqs": 8}


def greedy(rid: str, ids: list[int], max_tokens: int, adapter: str | None = None) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp, adapter=adapter)


def arrivals() -> list[tuple[int, GenerateRequest]]:
    """(step, request): requests join so the decode row count climbs through the buckets (1, 2, 3 -> 4,
    5 -> 8), then leave at different lengths; r4 repeats r0's prompt (a prefix hit)."""
    rng = random.Random(3)
    adapters = [None, "a0", "a1", "a2", None, "a0"]
    out = []
    for i, (step, adapter) in enumerate(zip((0, 2, 4, 6, 6, 6), adapters, strict=True)):
        prompt = out[0][1].prompt_token_ids + (50,) if i == 4 else [rng.randrange(1, 256) for _ in range(9)]
        out.append((step, greedy(f"r{i}", list(prompt), 12 - i + (i * 5) % 4, adapter)))
    return out


def run_scenario(mode: str, adapter_dirs, reqs: list[tuple[int, GenerateRequest]], **overrides):
    """Runs `reqs` ((step, request) arrivals) on a fresh engine; returns (core, tokens by request)."""
    core = make_core(MODEL, cuda_graphs=mode, **{**ENGINE, **overrides})
    for i, path in enumerate(adapter_dirs):
        core.add_adapter(f"a{i}", str(path))
        core.pin_adapter(f"a{i}")  # (loaded now: both runs schedule the same steps)
    pending, tokens, step = list(reqs), {}, 0
    while pending or core.has_work():
        while pending and pending[0][0] <= step:
            core.add_request(pending.pop(0)[1])
        for ev in core.step():
            assert ev.error is None, ev.error
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
        step += 1
    return core, tokens


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    cfg = _loaded(MODEL).config
    root = tmp_path_factory.mktemp("static_adapters")
    return [make_peft_dir(root / f"a{i}", cfg, rank=r, alpha=2 * r, targets="all", seed=30 + i, magnitude=0.2)
            for i, r in enumerate((4, 8, 16))]


def test_static_decode_matches_dynamic_across_buckets_adapters_prefix_hits_and_swap(adapter_dirs):
    kw = {"num_kv_blocks": 16, "preemption_mode": "swap", "speculative_tokens": 0}
    dynamic, want = run_scenario("off", adapter_dirs, arrivals(), **kw)
    static, got = run_scenario("on", adapter_dirs, arrivals(), **kw)
    assert dynamic.runner.static is None
    assert got == want
    assert {r: len(t) for r, t in got.items()} == {r.request_id: r.sampling.max_tokens for _, r in arrivals()}
    # the run had what the test claims: static steps in growing buckets, a prefix hit, swapping
    used = {b for b, n in static.runner.static.bucket_steps.items() if n}
    assert {1, 2, 4, 8} <= used, static.runner.static.bucket_steps
    assert static.kv.stats.prefix_hit_tokens > 0
    assert static.kv.stats.swapped_out_blocks > 0 and static.kv.stats.swapped_in_blocks > 0
    assert sum(static.scheduler.counters.preemptions.values()) > 0
    assert static.num_steps == dynamic.num_steps  # both runs scheduled the same steps


def test_static_decode_matches_dynamic_with_drafts():
    """Drafts are extra decode rows of their request (one block table, rising context lengths)."""
    reqs = [(0, greedy(f"r{i}", p, 12)) for i, p in enumerate(repetitive_prompts(2, seed=10))]  # (drafts kept)
    dynamic, want = run_scenario("off", [], reqs)
    static, got = run_scenario("on", [], reqs)
    assert got == want
    assert static.spec_accepted_tokens > 0 and static.spec_draft_tokens == dynamic.spec_draft_tokens
    assert any(b > 2 and n for b, n in static.runner.static.bucket_steps.items())  # 2 requests, more rows


def test_static_steps_with_adapters_run_the_graph_safe_lora_entry(adapter_dirs, monkeypatch):
    core = make_core(MODEL, cuda_graphs="on", **ENGINE)
    core.add_adapter("a0", str(adapter_dirs[0]))
    calls = []
    apply_static = core.lora.apply_static
    monkeypatch.setattr(core.lora, "apply_static", lambda *a: (calls.append(a[4]), apply_static(*a))[1])
    base = make_core(MODEL, cuda_graphs="off", **ENGINE)
    base.add_adapter("a0", str(adapter_dirs[0]))
    reqs = [greedy("x", [5, 6, 7, 8, 9], 4, "a0"), greedy("y", [11, 12, 13], 4)]
    assert [c.token_ids for c in core.run(reqs)] == [c.token_ids for c in base.run(reqs)]
    assert calls, "no static step ran an adapter"
    # every static LoRA call sees a bucket's rows: the adapter's slot, -1 for the base row and padding
    slot = core.lora.slot_of("a0")
    assert all(t.shape[0] in core.runner.static.buckets and set(t.tolist()) <= {slot, -1} for t in calls)


def test_padded_rows_write_only_the_scratch_block():
    """3 decoding requests fill bucket 4: the padded row's K/V go to the scratch block (the block past the pool),
    never to a block the pool handed out or kept free; the real blocks hold what the dynamic path wrote."""
    reqs = [greedy(f"r{i}", [20 + i, 21, 22 + i, 23, 24], 5) for i in range(3)]
    cores = {}
    for mode in ("off", "on"):
        core = make_core(MODEL, cuda_graphs=mode, **{**ENGINE, "speculative_tokens": 0, "num_kv_blocks": 16})
        handed = set()
        allocate = core.pool.allocate
        core.pool.allocate = lambda n, _a=allocate, _h=handed: (ids := _a(n), _h.update(ids))[0]
        core.run(reqs)
        cores[mode] = (core, handed)
    static, handed = cores["on"]
    dynamic, _ = cores["off"]
    kv = static.runner.kv_storage  # [layers, 2, blocks + 1, block_size, kv_heads, head_dim]
    n = static.pool.num_blocks
    assert kv.shape[2] == n + 1 and dynamic.runner.kv_storage.shape[2] == n
    assert static.runner.static.bucket_steps[4] > 0
    never = [b for b in range(n) if b not in handed]
    assert never and not kv[:, :, never].any()
    assert kv[:, :, n, 0].any()  # the scratch block took the padded row's K/V (slot 0 only)
    assert not kv[:, :, n, 1:].any()
    torch.testing.assert_close(kv[:, :, :n], dynamic.runner.kv_storage, rtol=1e-5, atol=1e-6)


def test_decode_attention_takes_fixed_split_scratch():
    case = make_case([("d", 150, 1), ("d", 95, 3), ("d", 0, 1)], 6, 2, 64, 16, torch.float32, seed=2)
    want = new_out(case)
    run_decode(case, want, num_splits=3)
    rows, heads = case.decode[0].shape[0], case.q.shape[1]
    part = torch.empty(rows, heads, 3, device=case.q.device)
    scratch = (part, torch.empty_like(part), torch.empty(rows, heads, 3, 64, device=case.q.device))
    got = new_out(case)
    paged_decode_attention(case.q, case.k_cache, case.v_cache, got, *case.decode, case.block_tables, case.scale,
                           case.max_len, num_splits=3, scratch=scratch)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="explicit num_splits"):
        paged_decode_attention(case.q, case.k_cache, case.v_cache, got, *case.decode, case.block_tables,
                               case.scale, 4096, scratch=scratch)
    with pytest.raises(ValueError, match="scratch part_acc"):
        paged_decode_attention(case.q, case.k_cache, case.v_cache, got, *case.decode, case.block_tables,
                               case.scale, case.max_len, num_splits=3, scratch=(part, part, part))


def test_modes_buckets_config_and_flag():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert static_decode_mode("on", cpu, "triton_paged") == "eager"
    assert static_decode_mode("auto", cpu, "triton_paged") is None
    assert static_decode_mode("auto", cuda, "triton_paged") == "graphs"
    assert static_decode_mode("on", cuda, "triton_paged") == "graphs"
    assert static_decode_mode("off", cuda, "triton_paged") is None
    assert static_decode_mode("on", cuda, "torch_sdpa") is None
    assert buckets_for(1) == (1,) and buckets_for(24) == (1, 2, 4, 8, 16, 32)
    assert buckets_for(64 * 5) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--cuda-graphs", "off"]).cuda_graphs == "off"
    assert p.parse_args([]).cuda_graphs is None
