"""Model families by HF architecture (models/registry.py) and the named layer weights they build."""

from __future__ import annotations

import dataclasses

import pytest

from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.kernels.cpu import decode_step
from loraplex.engine.models import registry
from loraplex.engine.models.hf_loader import hf_config
from loraplex.engine.models.layer_ops import CpuKernelOps
from loraplex.engine.models.llama import PROJECTIONS, LayerWeights, LlamaModel
from loraplex.engine.models.loader import load_model, resolve_model
from loraplex.engine.models.registry import ModelFamily, family_for_gguf, family_for_hf, register
from loraplex.engine.models.synthetic import synthetic_model
from tests.conftest import _loaded, make_core
from tests.unit.test_loader import write_tiny_gguf

HF_SUPPORTED = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
# the smallest config.json hf_config reads
RAW = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.fixture
def scratch_registry(monkeypatch):
    """Families registered in the test go with it: the registry is a copy for its duration."""
    monkeypatch.setattr(registry, "_BY_HF", dict(registry._BY_HF))


def test_the_three_families_and_their_flags():
    assert [(f.architecture, f.gguf_arch, f.qkv_bias_default, f.fused_cpu_decode, f.model)
            for f in registry.families()] == [
        ("LlamaForCausalLM", "llama", False, True, LlamaModel),
        ("MistralForCausalLM", None, False, True, LlamaModel),
        ("Qwen2ForCausalLM", "qwen2", True, True, LlamaModel)]
    assert family_for_hf("MistralForCausalLM") is registry.MISTRAL
    assert family_for_gguf("llama") is registry.LLAMA  # Mistral GGUFs say "llama" too
    assert family_for_gguf("qwen2") is registry.QWEN2


def test_an_unknown_hf_architecture_is_refused_by_name():
    with pytest.raises(ValueError, match=rf"^cfg.json: architecture 'GPT2LMHeadModel' is not supported "
                                         rf"\(supported: {HF_SUPPORTED}\)$"):
        hf_config({"architectures": ["GPT2LMHeadModel"], **RAW}, source="cfg.json")
    with pytest.raises(ValueError, match=rf"^architecture None is not supported \(supported: {HF_SUPPORTED}\)$"):
        hf_config(RAW, source="")  # no architectures key
    with pytest.raises(ValueError, match=r"^m: architecture 'FalconForCausalLM' is not supported \(supported: Llama"):
        family_for_hf("FalconForCausalLM", "m")


def test_an_unknown_gguf_architecture_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^f.gguf: GGUF architecture 'falcon' is not supported "
                                         r"\(supported: llama, qwen2\)$"):
        family_for_gguf("falcon", "f.gguf")
    with pytest.raises(ValueError, match=r"GGUF architecture 'LlamaForCausalLM' is not supported"):
        family_for_gguf("LlamaForCausalLM")  # HF names are not GGUF names


def test_hf_config_takes_its_familys_architecture_and_bias_default():
    qwen = hf_config({"architectures": ["Qwen2ForCausalLM"], **RAW})
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.attention_bias
    assert not hf_config({"architectures": ["Qwen2ForCausalLM"], "attention_bias": False, **RAW}).attention_bias
    mistral = hf_config({"architectures": ["MistralForCausalLM"], **RAW})
    assert mistral.architecture == "MistralForCausalLM" and not mistral.attention_bias
    assert mistral != dataclasses.replace(mistral, architecture="LlamaForCausalLM")


def test_a_gguf_loads_as_the_family_that_claims_its_arch(tmp_path, scratch_registry):
    registry.unregister("LlamaForCausalLM")
    register(ModelFamily("TestLlamaForCausalLM", gguf_arch="llama", qkv_bias_default=False, fused_cpu_decode=True))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    assert load_model(resolve_model(str(path)), cache_dir=tmp_path / "c").config.architecture == "TestLlamaForCausalLM"
    with pytest.raises(ValueError, match="'llama' already loads as TestLlamaForCausalLM"):
        register(ModelFamily("OtherForCausalLM", gguf_arch="llama", qkv_bias_default=False, fused_cpu_decode=True))


def test_a_model_of_an_unregistered_architecture_is_not_built():
    config, weights, _ = synthetic_model("tiny")
    with pytest.raises(ValueError, match="model config: architecture 'NopeForCausalLM' is not supported"):
        LlamaModel(dataclasses.replace(config, architecture="NopeForCausalLM"), weights)


@pytest.mark.cpu_kernels
def test_layer_weights_are_named_in_the_fused_steps_order():
    config, weights, _ = synthetic_model("tiny-bias")
    model = LlamaModel(config, weights)
    layer = model.layers[1]
    assert isinstance(layer, LayerWeights)
    assert layer.input_norm is weights["layers.1.input_norm"] and layer.post_norm is weights["layers.1.post_norm"]
    assert layer.qkv_bias is weights["layers.1.qkv_bias"]
    for m in PROJECTIONS:  # packed once, over the loaded weight
        assert getattr(layer, m).weight is weights[f"layers.1.{m}"]
    assert LayerWeights._fields == decode_step.LAYER_WEIGHTS  # the C step marshals the fields in this order
    assert PROJECTIONS == decode_step.LORA_MODULES
    assert model.packed_bytes() == sum(getattr(lw, m).data.numel() * 4 for lw in model.layers for m in PROJECTIONS) \
        + model.lm_head_w.data.numel() * 4


def _greedy_tokens(core: EngineCore) -> list[list[int]]:
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(f"r{i}", "synthetic:tiny", prompt_token_ids=tuple(range(3 + i, 12 + 5 * i)), sampling=sp)
            for i in range(4)]
    return [c.token_ids for c in core.run(reqs)]


@pytest.mark.cpu_kernels
def test_a_family_without_the_fused_step_decodes_op_by_op_to_the_same_tokens(scratch_registry):
    fused = make_core("synthetic:tiny", device="cpu")
    want = _greedy_tokens(fused)
    assert fused.runner.model.ops._step_models  # the baseline's decode steps took the fused C step
    register(ModelFamily("TinyOpByOpForCausalLM", gguf_arch=None, qkv_bias_default=False, fused_cpu_decode=False))
    base = _loaded("synthetic:tiny", "cpu")
    loaded = dataclasses.replace(base, config=dataclasses.replace(base.config, architecture="TinyOpByOpForCausalLM"))
    core = EngineCore(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32", num_kv_blocks=256,
                                   block_size=16), loaded=loaded)
    ops = core.runner.model.ops
    assert isinstance(ops, CpuKernelOps) and not ops.fused_decode  # the C kernels, op by op
    got = _greedy_tokens(core)
    assert not ops._step_models  # no decode step built the fused step's table
    assert got == want and all(len(t) == 10 for t in got)
