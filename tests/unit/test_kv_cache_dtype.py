"""EngineConfig.kv_cache_dtype end to end: greedy tokens against an fp32 cache, preemption and prefix caching
over 8-bit blocks, the KV pool's sizing, and the refusals."""

from __future__ import annotations

import re

import pytest
import torch

from loraplex.cli.bench.kv import next_token_agreement
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.attention.registry import attention_backend
from loraplex.engine.config import EngineConfig
from loraplex.engine.memory import block_bytes, kv_blocks
from tests.conftest import _loaded, make_core
from tests.unit.test_engine_core import greedy, mixed_prompts

NARROW = ("bfloat16", "float16", "int8", "fp8")


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of positions where two runs' greedy tokens agree."""
    pairs = [(x, y) for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def _tokens(prompts, max_tokens=16, model="synthetic:tiny", **config) -> tuple[list[list[int]], object]:
    core = make_core(model, max_num_batched_tokens=64, **config)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = core.run([GenerateRequest(f"r{i}", model, prompt_token_ids=tuple(p), sampling=sp)
                    for i, p in enumerate(prompts)])
    return [c.token_ids for c in out], core


def test_an_unknown_kv_cache_dtype_names_the_valid_ones():
    with pytest.raises(ValueError, match=re.escape("kv_cache_dtype must be auto or one of float32, bfloat16, "
                                                   "float16, int8, fp8, got 'int4'")):
        EngineConfig(kv_cache_dtype="int4")


def test_a_backend_that_cannot_hold_the_heads_in_8_bits_is_refused_in_one_line():
    with pytest.raises(ValueError, match=re.escape("attention backend torch_sdpa cannot serve this model: head_dim "
                                                   "34 in an 8-bit KV cache (it needs a multiple of 4")) as e:
        attention_backend("torch_sdpa", torch.device("cpu"), torch.float32, 34, torch.float8_e4m3fn)
    assert "\n" not in str(e.value)
    assert attention_backend("torch_sdpa", torch.device("cpu"), torch.float32, 34, torch.bfloat16)


def test_8bit_blocks_count_their_scales_and_fit_about_four_times_as_many():
    cfg = _loaded("synthetic:tiny").config  # head_dim 16: an 8-bit row is 16 + 4 bytes
    per = {d: block_bytes(EngineConfig(kv_cache_dtype=d), cfg) for d in ("float32", "bfloat16", "int8", "fp8")}
    assert per["float32"] == 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert per["bfloat16"] * 2 == per["float32"]
    assert per["int8"] == per["fp8"] == 16 * 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    mib = 2**20
    blocks = {d: kv_blocks(EngineConfig(kv_cache_dtype=d, kv_cache_bytes=mib), cfg) for d in ("float32", "int8")}
    assert blocks["int8"] == mib // per["int8"] and blocks["int8"] >= 3 * blocks["float32"]
    core = make_core(kv_cache_dtype="int8", num_kv_blocks=None, kv_cache_bytes=mib)
    assert core.pool.num_blocks == blocks["int8"]
    assert core.runner.kv_storage.numel() * core.runner.kv_storage.element_size() == blocks["int8"] * per["int8"]


@pytest.mark.parametrize("backend", ["cpu_c", "torch_sdpa"])
def test_each_cache_type_keeps_greedy_tokens_of_an_fp32_cache(backend):
    prompts = mixed_prompts(6, seed=3)
    want, _ = _tokens(prompts, attention_backend=backend)
    same, core = _tokens(prompts, attention_backend=backend, kv_cache_dtype="float32")
    assert same == want and core.runner.kv_storage.dtype == torch.float32
    for dtype in NARROW:
        got, core = _tokens(prompts, attention_backend=backend, kv_cache_dtype=dtype)
        assert core.runner.kv_storage.element_size() == (1 if dtype in ("int8", "fp8") else 2)
        assert agreement(got, want) >= 0.9, dtype


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_hits_over_8bit_blocks_keep_the_tokens(mode):
    """A pool too small for the batch preempts (recomputed, or swapped out and in with their scales); a second
    wave on the first's prompts hits the prefix cache. Tokens equal a roomy int8 engine's first wave."""
    prompts = mixed_prompts(6, seed=4)
    roomy, roomy_core = _tokens(prompts, 40, kv_cache_dtype="int8")
    tight, core = _tokens(prompts, 40, kv_cache_dtype="int8", num_kv_blocks=14, preemption_mode=mode)
    assert tight == roomy
    assert core.scheduler.num_preemptions > 0
    if mode == "swap":
        assert core.kv.stats.swapped_out_blocks > 0
    again = roomy_core.run([greedy(f"s{i}", p, max_tokens=8) for i, p in enumerate(prompts[:2])])
    assert roomy_core.kv.stats.prefix_hit_tokens > 0
    assert [c.token_ids for c in again] == [t[:8] for t in roomy[:2]]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "fp8", "bfloat16"])
def test_default_model_greedy_tokens_over_a_narrow_cache(dtype, default_model):
    """smollm2-135m, four prompts, 32 greedy tokens: given the fp32 cache's tokens so far, the narrow cache's next
    token is the same at >= 90% of positions (teacher-forced: one early difference would decide every later
    position of a free run); bf16 also keeps >= 90% of free-running positions. (int8 does over some prompts and
    not others: on "def fibonacci(n):" fp32's first token leads the next by 0.04 nats, and an int8 cache, with K
    smoothed or not, moves the two by about that much. Its free-running figure is measured over 32-96 prompts by
    `bench kv`, bench/RESULTS.md.)"""
    texts = ["The history of the printing press begins", "def fibonacci(n):\n    ",
             "Photosynthesis is the process by which", "List three facts about the moon:"]
    model = "smollm2-135m"
    prompts = [default_model.tokenizer.encode(t) for t in texts]
    want, _ = _tokens(prompts, 32, model=model)
    got, core = _tokens(prompts, 32, model=model, kv_cache_dtype=dtype)
    if dtype == "bfloat16":
        assert agreement(got, want) >= 0.9
    assert next_token_agreement(core, model, prompts, want) >= 0.9


def test_triton_paged_over_an_fp8_cache_gives_torch_sdpas_tokens():
    """The Triton kernels (the interpreter on the CPU), dynamic steps and static decode steps, read the same
    quantized values as torch_sdpa: the same greedy tokens (int8's kernel path: test_paged_attention_kv_dtypes)."""
    dtype = "fp8"
    prompts = mixed_prompts(3, seed=5)
    want, _ = _tokens(prompts, 8, attention_backend="torch_sdpa", kv_cache_dtype=dtype)
    for graphs in ("off", "on"):
        got, core = _tokens(prompts, 8, attention_backend="triton_paged", kv_cache_dtype=dtype, cuda_graphs=graphs)
        assert got == want, graphs
        assert (core.runner.static is not None and core.runner.static.steps > 0) == (graphs == "on")
