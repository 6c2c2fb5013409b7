"""Block-quantized base weights in the engine (EngineConfig.weight_dtype auto / int8 / int4, engine/quant.py).

The kernels dequantize in registers exactly as gguf does, so an engine over blocks must give the tokens and
log-probabilities of an fp32 engine over the dequantized values, bit for bit, on every path (chunked
prefill, decode, adapters through lora.c). Memory counts the blocks, not fp32 weights.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.kernels.cpu.linear import pack
from loraplex.engine.models.loader import load_model, resolve_model
from loraplex.engine.quant import BlockWeight, dequantize
from tests.conftest import _loaded
from tests.unit.test_bf16_weights import run_mixed_adapters, run_with_logprobs
from tests.unit.test_engine_core import MODEL, mixed_prompts
from tests.unit.test_engine_lora import adapter_dirs, req  # noqa: F401 (adapter_dirs: a fixture)

pytestmark = pytest.mark.cpu_kernels
DEFAULT = "smollm2-135m"


def config(model: str = MODEL, **overrides) -> EngineConfig:
    params = {"model": model, "device": "cpu", "dtype": "float32", "num_kv_blocks": 256}
    return EngineConfig(**(params | overrides))


def dequantized(loaded):
    """The same model with every block tensor replaced by its fp32 values."""
    return dataclasses.replace(loaded, weights={k: dequantize(v) if isinstance(v, BlockWeight) else v
                                                for k, v in loaded.weights.items()})


def assert_same_tokens(got: dict, want: dict, logprob_tolerance: float) -> None:
    """Each request's tokens equal, their log-probabilities within the tolerance."""
    assert got.keys() == want.keys()
    for rid, pairs in want.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in pairs], rid
        assert max(abs(a - b) for (_, a), (_, b) in zip(got[rid], pairs, strict=True)) <= logprob_tolerance, rid


@pytest.mark.parametrize("weight_dtype, fmt", [("int8", "q8_0"), ("int4", "q4_1")])
def test_a_quantized_engine_gives_the_tokens_of_its_dequantized_values_in_fp32(weight_dtype, fmt,
                                                                                adapter_dirs):  # noqa: F811
    """Adapters of several ranks beside base-model requests, prompts long enough for chunked prefill."""
    cfg = config(weight_dtype=weight_dtype, lora_merge_after_steps=0, max_num_batched_tokens=64)
    loaded = load_model(resolve_model(MODEL), quant=cfg.weight_quant)
    assert loaded.weights["layers.0.qkv"].fmt == fmt and loaded.weights["lm_head"].fmt == "q8_0"
    engines = {"blocks": EngineCore(cfg, loaded=loaded),
               "fp32": EngineCore(dataclasses.replace(cfg, weight_dtype="float32"), loaded=dequantized(loaded))}
    model = engines["blocks"].runner.model
    assert model.layers[0].qkv.kind == fmt and model.lm_head_w.kind == "q8_0"
    assert engines["fp32"].runner.model.layers[0].qkv.kind == "f32"
    engines["plain"] = EngineCore(config(lora_merge_after_steps=0, max_num_batched_tokens=64), loaded=_loaded(MODEL))
    outputs = run_mixed_adapters(engines, adapter_dirs, ["a0", None, "a1", "a3", None, "a0"], 3, 8)
    if fmt == "q8_0":
        assert outputs["blocks"] == outputs["fp32"]
    else:  # a step of one token sums 4-bit weights per group (linear.c's ROW_SUMS): the same tokens, close log-probs
        assert_same_tokens(outputs["blocks"], outputs["fp32"], logprob_tolerance=1e-4)
    assert outputs["plain"] != outputs["fp32"]  # the quantization is real


@pytest.mark.slow
def test_the_default_model_keeps_its_gguf_blocks_and_gives_the_tokens_of_their_fp32_values():
    """SmolLM2's Q4_1 projections and Q8_0 embedding / LM head stay as stored (auto), read at about a fifth
    of the fp32 bytes, and greedy decoding gives exactly the tokens of the same values dequantized to fp32
    (weight_dtype float32); log-probabilities to fp32 rounding (a step of one token sums per group)."""
    blocks = EngineCore(config(DEFAULT, num_kv_blocks=64))
    fp32 = EngineCore(config(DEFAULT, num_kv_blocks=64, weight_dtype="float32"))
    model = blocks.runner.model
    assert model.layers[0].qkv.kind == "q4_1" and model.lm_head_w.kind == "q8_0"
    assert model.packed_bytes() * 5 < fp32.runner.model.packed_bytes()
    # resident: the blocks once (their panels; the embedding's rows come from the LM head's), plus the norms
    assert model.packed_bytes() < blocks.weight_bytes < model.packed_bytes() + 200_000
    assert blocks.weight_bytes * 10 < fp32.weight_bytes
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    reqs = [GenerateRequest(f"p{i}", DEFAULT, prompt=p, sampling=sp) for i, p in enumerate(prompts)]
    assert_same_tokens(run_with_logprobs(blocks, reqs), run_with_logprobs(fp32, reqs), logprob_tolerance=1e-4)


def test_resident_memory_counts_the_blocks():
    """A pool sizes a block model by its blocks (as loaded and packed), not by fp32 weights."""
    from loraplex.engine.pool import ModelPool

    pool = ModelPool(memory_budget=2**31, cpu_budget_bytes=2**31, device="cpu")
    try:
        for name, wdtype in (("f", "float32"), ("q", "int4")):
            pool.register_model(name, MODEL, config=config(weight_dtype=wdtype, num_kv_blocks=8))
        f, q = pool.entry("f"), pool.entry("q")
        loaded = load_model(resolve_model(MODEL), quant="q4_1")
        assert q.host_bytes == sum(w.nbytes for w in loaded.weights.values())
        assert q.host_bytes < 0.6 * f.host_bytes  # (tiny: its float embedding is a third of the weights)
        assert q.device_bytes < f.device_bytes
    finally:
        pool.shutdown()


def test_a_merged_adapter_over_blocks_is_a_bf16_copy_of_the_dequantized_weights_plus_the_delta(
        adapter_dirs):  # noqa: F811
    core = EngineCore(config(weight_dtype="int4", lora_merge_after_steps=2))
    core.add_adapter("a2", str(adapter_dirs[2]))
    core.run([req(f"m{i}", p, "a2", 8) for i, p in enumerate(mixed_prompts(2, seed=4))])
    merge = core.runner.lora_merge
    assert merge.builds == 1 and merge.steps > 0
    merged = merge._layers[0]
    assert merged.qkv.kind == "bf16" and core.runner.model.layers[0].qkv.kind == "q4_1"
    base = dequantize(core.runner.model.w["layers.0.qkv"])
    want = torch.empty_like(base)
    assert core.lora.merged_weight(0, "qkv", merge._key[0], base, want)
    assert torch.equal(merged.qkv.data, pack(want, dtype=torch.bfloat16).data)


def test_weight_dtype_names_the_valid_ones():
    with pytest.raises(ValueError, match="must be one of auto, float32, bfloat16, int8, int4, fp8, got 'int2'"):
        config(weight_dtype="int2")
    assert config(weight_dtype="int8").weight_quant == "q8_0" and config().weight_quant == "keep"
    assert config(weight_dtype="float32").weight_quant is None


def test_cuda_int8_weights_run_through_the_w8a16_kernel_with_their_dequantized_values(monkeypatch):
    """weight_dtype int8 on CUDA: projections and LM head quantized per output channel (kernels/quant_linear.py)
    and run by TorchOps through the W8A16 kernel (here in Triton's interpreter); the logits are those of the
    dequantized weights in fp32 to fp32 rounding."""
    from loraplex.engine.attention.torch_sdpa import build_metadata
    from loraplex.engine.kernels.quant_linear import QuantizedLinearWeight
    from loraplex.engine.kv.block_pool import allocate_kv_tensors
    from loraplex.engine.models import layer_ops
    from loraplex.engine.models.llama import LlamaModel
    from loraplex.engine.models.loader import quantized_weights

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(layer_ops, "uses_cpu_kernels", lambda device, dtype: False)  # the CUDA path's ops
    loaded = _loaded(MODEL)
    weights = quantized_weights(loaded.weights, "int8")
    assert isinstance(weights["layers.0.qkv"], QuantizedLinearWeight) and isinstance(weights["lm_head"],
                                                                                       QuantizedLinearWeight)
    values = {k: v.dequantize() if isinstance(v, QuantizedLinearWeight) else v for k, v in weights.items()}
    cfg = loaded.config
    n = 12
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    logits = []
    for w in (weights, values):
        kv = allocate_kv_tensors(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                                 torch.device("cpu"))
        model = LlamaModel(cfg, w)
        logits.append(model.forward(ids, torch.arange(n), build_metadata([(0, n, [0])], 16, "cpu"), kv,
                                    torch.arange(n)))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits[1], LlamaModel(cfg, loaded.weights).forward(
        ids, torch.arange(n), build_metadata([(0, n, [0])], 16, "cpu"),
        allocate_kv_tensors(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                            torch.device("cpu")), torch.arange(n)), atol=1e-5)  # (the quantization is real)


def test_weight_dtypes_refused_on_the_wrong_device():
    with pytest.raises(ValueError, match="weight_dtype fp8 runs on CUDA only"):
        config(weight_dtype="fp8")
    assert config(weight_dtype="int4").weight_quant == "q4_1"
