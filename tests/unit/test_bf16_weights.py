"""EngineConfig.weight_dtype="bfloat16": the base weights rounded to bf16 once at load, under an fp32
model, with the CPU kernels' projections packed in bf16. Every path must compute with the rounded
values, so the engine gives exactly the tokens of an fp32 engine over weights rounded beforehand.

The packing is the CPU kernels': the tests of packed panels and their accounting are marked cpu_kernels,
skipped off the CPU; loading and config checks run on the test device (--device).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.kernels.cpu.linear import pack
from loraplex.engine.models.layer_ops import weight_copies
from loraplex.engine.models.loader import load_model, resolve_model
from tests.conftest import _loaded, test_device
from tests.unit.test_engine_core import MODEL, mixed_prompts
from tests.unit.test_engine_lora import adapter_dirs, req  # noqa: F401 (adapter_dirs: a fixture)

BF16 = torch.bfloat16


def config(**overrides) -> EngineConfig:
    params = {"model": MODEL, "device": str(test_device()), "dtype": "float32", "num_kv_blocks": 256}
    return EngineConfig(**(params | overrides))


def rounded_fp32_core(**overrides) -> EngineCore:
    """An fp32 engine (fp32 panels) over the weights rounded to bf16 beforehand."""
    base = _loaded(MODEL)
    loaded = dataclasses.replace(base, weights={k: v.to(BF16).float() for k, v in base.weights.items()})
    return EngineCore(config(**overrides), loaded=loaded)


def run_with_logprobs(core: EngineCore, reqs: list[GenerateRequest]) -> dict[str, list]:
    """Each request's (token, log-probability) pairs, stepping the engine until all finish."""
    for r in [core.prepare(r) for r in reqs]:
        core.add(r)
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    while core.has_work():
        for ev in core.step():
            out[ev.request_id] += [(t, lp.logprob) for t, lp in zip(ev.token_ids, ev.logprobs, strict=True)]
    return out


def run_mixed_adapters(engines: dict[str, EngineCore], dirs, adapters: list[str | None], seed: int,
                       max_tokens: int) -> dict[str, dict[str, list]]:
    """Each engine's (token, log-probability) pairs for the same greedy requests, one per entry of `adapters`
    (a0, a1 and a3 registered in every engine; None: the base model), over mixed_prompts."""
    prompts = mixed_prompts(len(adapters), seed=seed)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    reqs = [GenerateRequest(f"r{i}", MODEL, prompt_token_ids=tuple(p), sampling=sp, adapter=a)
            for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))]
    outputs = {}
    for name, core in engines.items():
        for i in (0, 1, 3):
            core.add_adapter(f"a{i}", str(dirs[i]))
        outputs[name] = run_with_logprobs(core, reqs)
    return outputs


def test_load_model_rounds_every_weight_into_fresh_tensors(device):
    src = resolve_model(MODEL)
    plain, rounded = load_model(src, torch.float32, device), load_model(src, torch.float32, device, weight_dtype=BF16)
    assert plain.rounded_to is None and rounded.rounded_to == BF16
    for name, w in plain.weights.items():
        assert rounded.weights[name].dtype == torch.float32
        assert torch.equal(rounded.weights[name], w.to(BF16).float())
    assert not torch.equal(rounded.weights["embed"], plain.weights["embed"])  # (random weights: most change)


@pytest.mark.cpu_kernels
def test_a_bf16_weight_engine_gives_the_tokens_of_the_rounded_weights_in_fp32(adapter_dirs):  # noqa: F811
    """A batch mixing adapters of ranks 4 to 64 (lora.c) with base-model requests, and prompts long
    enough for chunked prefill: prefill and decode paths alike use the rounded weights, so tokens and
    their log-probabilities equal those of an fp32 engine over the rounded weights, bit for bit."""
    engines = {"bf16": EngineCore(config(weight_dtype="bfloat16", lora_merge_after_steps=0,
                                         max_num_batched_tokens=64)),
               "rounded": rounded_fp32_core(lora_merge_after_steps=0, max_num_batched_tokens=64),
               "fp32": EngineCore(config(lora_merge_after_steps=0, max_num_batched_tokens=64), loaded=_loaded(MODEL))}
    model = engines["bf16"].runner.model
    assert model.layers[0][1].data.dtype == BF16 and model.lm_head_w.data.dtype == BF16
    assert engines["rounded"].runner.model.layers[0][1].data.dtype == torch.float32
    outputs = run_mixed_adapters(engines, adapter_dirs, ["a0", None, "a1", "a3", None, "a0", "a3"], 11, 10)
    assert outputs["bf16"] == outputs["rounded"]
    assert outputs["bf16"] != outputs["fp32"]  # the rounding is real: the unrounded weights' log-probabilities differ


@pytest.mark.cpu_kernels
def test_a_merged_adapter_copy_is_packed_in_bf16_too(adapter_dirs):  # noqa: F811
    """The merged copy (lora/merged.py) of a bf16-weight engine holds W + s*B@A rounded to bf16 (one
    decode step takes one weight type) and costs half of an fp32 copy."""
    core = EngineCore(config(weight_dtype="bfloat16", lora_merge_after_steps=2))
    core.add_adapter("a2", str(adapter_dirs[2]))
    core.run([req(f"m{i}", p, "a2", 8) for i, p in enumerate(mixed_prompts(2, seed=4))])
    merge = core.runner.lora_merge
    assert merge.builds == 1 and merge.steps > 0
    merged, base = merge._layers[0], core.runner.model.layers[0]
    assert merged[1].data.dtype == BF16
    w = core.runner.model.w["layers.0.qkv"]
    want = torch.empty_like(w)
    assert core.lora.merged_weight(0, "qkv", merge._key[0], w, want)
    assert torch.equal(merged[1].data, pack(want, dtype=BF16).data)
    assert merge.nbytes() == sum(layer[i].data.numel() * 2 for layer in merge._layers for i in (1, 3, 5, 6))
    assert base[1].data.dtype == BF16


def test_an_engine_refuses_weights_not_rounded_for_its_weight_dtype():
    with pytest.raises(ValueError, match="weight_dtype bfloat16 needs weights loaded with weight_dtype"):
        EngineCore(config(weight_dtype="bfloat16"), loaded=_loaded(MODEL))


def test_weight_dtype_is_checked_when_the_config_is_made():
    with pytest.raises(ValueError, match="needs a float32 model"):
        config(dtype="float16", weight_dtype="bfloat16")
    assert config(weight_dtype="bfloat16").weight_torch_dtype == BF16
    assert config().weight_torch_dtype == torch.float32
    assert config(dtype="bfloat16", weight_dtype="bfloat16").weight_torch_dtype == BF16  # (nothing to round)


@pytest.mark.cpu_kernels
def test_memory_accounting_counts_bf16_panels_at_half_size():
    cpu = torch.device("cpu")
    assert weight_copies(cpu, torch.float32) == 2
    assert weight_copies(cpu, torch.float32, BF16) == 1.5


@pytest.mark.cpu_kernels
def test_a_pool_counts_bf16_panels_at_half_size_and_reloads_the_rounded_weights():
    """Three models in a budget for two: bf16 panels make a resident model 1.5x its fp32 weights (not
    2x), and one evicted to the CPU tier comes back with its weights still rounded (rounded_to travels
    with them), giving the tokens it gave before."""
    from tests.unit.test_model_pool import SMALL, host_bytes, make_pool, model_bytes, req, run

    config = dataclasses.replace(SMALL, weight_dtype="bfloat16")
    pool = make_pool(config=config, budget=int(2.2 * (model_bytes() - host_bytes() / 2)))
    try:
        first = run(pool, [req("a1", "m1")])
        assert pool.stats()["m1"]["device_bytes"] == model_bytes() - host_bytes() // 2
        run(pool, [req("b1", "m2")])
        run(pool, [req("c1", "m3")])  # m1, the least recently used, goes to the CPU tier
        assert pool.stats()["m1"]["tier"] == "cpu"
        assert run(pool, [req("a2", "m1")])["a2"] == first["a1"]
        assert pool.entry("m1").core.runner.model.layers[0][1].data.dtype == BF16
    finally:
        pool.shutdown()


@pytest.mark.cpu_kernels
def test_stats_count_the_loaded_weights_and_the_packed_copies_at_their_dtype():
    fp32 = EngineCore(config(), loaded=_loaded(MODEL))
    bf16 = EngineCore(config(weight_dtype="bfloat16"))
    loaded = fp32.runner.model.weight_bytes()
    assert bf16.runner.model.weight_bytes() == loaded  # (fp32 tensors holding the rounded values)
    packed32 = fp32.stats().models.weight_bytes - loaded
    assert packed32 == fp32.runner.model.packed_bytes() > 0
    assert bf16.stats().models.weight_bytes == loaded + packed32 // 2
