"""PEFT adapter parsing: valid layouts load exactly; every bad adapter is refused naming its field or tensor."""

from __future__ import annotations

import json
import math
import os
import threading

import pytest
import torch

from loraplex.engine.api import InvalidRequestError
from loraplex.engine.lora.peft import AdapterError, LoraWeights, load_peft_adapter
from loraplex.engine.models.loader import load_model, resolve_model
from tests.lora_factory import MISSING, make_peft_dir, read_tensors, tensor_key, write_tensors

ALL = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def config():
    return load_model(resolve_model("synthetic:tiny")).config


def refused(path, config, *needles: str, max_rank: int = 64) -> AdapterError:
    with pytest.raises(AdapterError) as info:
        load_peft_adapter(path, config, max_rank=max_rank)
    err = info.value
    assert err.code == "invalid_adapter" and isinstance(err, InvalidRequestError)
    for needle in needles:
        assert needle in err.message, f"{needle!r} not in {err.message!r}"
    return err


def test_loads_valid_adapter_exactly(tmp_path, config):
    path = make_peft_dir(tmp_path / "a", config, rank=8, alpha=16, targets="all", seed=1)
    lora = load_peft_adapter(path, config)
    assert isinstance(lora, LoraWeights)
    assert (lora.rank, lora.alpha, lora.scaling, lora.use_rslora) == (8, 16.0, 2.0, False)
    assert lora.target_modules == ALL and lora.layers == (0, 1)
    raw = read_tensors(path)
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    dims = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}
    for layer in range(config.num_layers):
        for m, (in_f, out_f) in dims.items():
            a, b = lora.a(layer, m), lora.b(layer, m)
            assert a.shape == (8, in_f) and b.shape == (out_f, 8)
            assert a.dtype == b.dtype == torch.float32 and a.device.type == "cpu"
            assert torch.equal(a, raw[tensor_key(layer, m, "A")])
            assert torch.equal(b, raw[tensor_key(layer, m, "B")])
            torch.testing.assert_close(lora.delta(layer, m), 2.0 * b @ a)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tensors_load_as_fp32(tmp_path, config, dtype):
    path = make_peft_dir(tmp_path, config, rank=4, alpha=8, targets=["q_proj", "v_proj"], seed=2, dtype=dtype)
    lora = load_peft_adapter(path, config)
    raw = read_tensors(path)[tensor_key(0, "q", "B")]
    assert lora.b(0, "q").dtype == torch.float32 and lora.buffer is None  # a converted copy
    assert torch.equal(lora.b(0, "q"), raw.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_of_one_header_share_one_read_only_layout(tmp_path, config, dtype):
    """Adapters of one shape (byte-identical headers) share their offsets mapping, which the slots key
    their block tables on; each still holds its own values. Another rank is another layout."""
    loras = [load_peft_adapter(make_peft_dir(tmp_path / f"a{seed}", config, rank=8, alpha=16, targets="all",
                                             seed=seed, dtype=dtype), config) for seed in (1, 2)]
    other = load_peft_adapter(make_peft_dir(tmp_path / "r4", config, rank=4, alpha=8, targets="all", seed=3,
                                            dtype=dtype), config)
    assert loras[0].offsets is loras[1].offsets and other.offsets is not loras[0].offsets
    with pytest.raises(TypeError):
        loras[0].offsets[(0, "q")] = (0, 0)  # shared: nobody may change it
    for seed, lora in zip((1, 2), loras, strict=True):
        raw = read_tensors(tmp_path / f"a{seed}")
        assert torch.equal(lora.a(1, "down"), raw[tensor_key(1, "down", "A")].float())
        assert torch.equal(lora.b(1, "down"), raw[tensor_key(1, "down", "B")].float())
    assert not torch.equal(loras[0].a(1, "down"), loras[1].a(1, "down"))


def test_rslora_scaling(tmp_path, config):
    path = make_peft_dir(tmp_path, config, rank=16, alpha=8, targets="all", seed=3, use_rslora=True)
    lora = load_peft_adapter(path, config)
    assert lora.use_rslora and lora.scaling == pytest.approx(8 / math.sqrt(16)) == 2.0
    plain = load_peft_adapter(make_peft_dir(tmp_path / "p", config, rank=16, alpha=8, targets="all", seed=3), config)
    assert plain.scaling == 0.5


def test_target_modules_as_single_string_and_all_linear(tmp_path, config):
    lora = load_peft_adapter(make_peft_dir(tmp_path / "s", config, 4, 4, ["v"], 4, target_modules="v_proj"), config)
    assert lora.target_modules == ("v",) and set(lora.offsets) == {(0, "v"), (1, "v")}
    lora = load_peft_adapter(make_peft_dir(tmp_path / "a", config, 4, 4, "all", 4, target_modules="all-linear"),
                             config)
    assert lora.target_modules == ALL


def test_default_adapter_name_keys_and_layer_subset(tmp_path, config):
    path = make_peft_dir(tmp_path, config, 4, 8, ["q", "down"], 5, adapter_name="default", layers_to_transform=[1])
    assert tensor_key(1, "q", "A", "default") in read_tensors(path)
    lora = load_peft_adapter(path, config)
    assert lora.layers == (1,) and set(lora.offsets) == {(1, "q"), (1, "down")}
    assert lora.delta(0, "q") is None


@pytest.mark.parametrize("overrides, needles", [
    ({"peft_type": "PREFIX_TUNING"}, ["peft_type", "PREFIX_TUNING"]),
    ({"peft_type": MISSING}, ["peft_type"]),
    ({"r": 0}, ["r must", "got 0"]),
    ({"r": 65}, ["r must", "max_lora_rank"]),
    ({"r": "8"}, ["r must"]),
    ({"lora_alpha": MISSING}, ["lora_alpha is missing"]),
    ({"lora_alpha": 0}, ["lora_alpha", "positive"]),
    ({"lora_alpha": -4.0}, ["lora_alpha", "positive"]),
    ({"target_modules": ["q_proj", "lm_head"]}, ["'lm_head'", "not supported"]),
    ({"target_modules": ["embed_tokens"]}, ["'embed_tokens'"]),
    ({"target_modules": "lm_head"}, ["'lm_head'"]),
    ({"target_modules": r".*\.(q_proj|v_proj)"}, ["target_modules", "regex"]),
    ({"target_modules": MISSING}, ["target_modules is missing"]),
    ({"target_modules": []}, ["target_modules"]),
    ({"modules_to_save": ["lm_head"]}, ["modules_to_save"]),
    ({"use_dora": True}, ["use_dora", "DoRA"]),
    ({"fan_in_fan_out": True}, ["fan_in_fan_out"]),
    ({"bias": "all"}, ["bias", "'all'"]),
    ({"bias": "lora_only"}, ["bias"]),
    ({"layers_to_transform": [0, 2]}, ["layers_to_transform", "layer 2", "2 layers"]),
    ({"layers_to_transform": 7}, ["layers_to_transform", "layer 7"]),
    ({"rank_pattern": {"q_proj": 0}}, ["rank_pattern['q_proj']", "integer in [1, 64]"]),
    ({"rank_pattern": {"q_proj": 65}}, ["rank_pattern['q_proj']", "max_lora_rank"]),
    ({"rank_pattern": {"q_proj": "4"}}, ["rank_pattern['q_proj']"]),
    ({"rank_pattern": ["q_proj"]}, ["rank_pattern must map"]),
    ({"rank_pattern": {"q_proj(": 4}}, ["rank_pattern key 'q_proj('", "not a valid pattern"]),
    # hostile patterns: a repeated group backtracks exponentially; an unbounded key
    ({"rank_pattern": {"(a+)+q_proj": 4}}, ["rank_pattern key '(a+)+q_proj'", "repeats a group"]),
    ({"alpha_pattern": {"(.|.)*x": 4}}, ["alpha_pattern key", "repeats a group"]),
    ({"rank_pattern": {"q" * 10_000: 4}}, ["rank_pattern keys", "1 to 256 characters"]),
    ({"alpha_pattern": {"v_proj": -2}}, ["alpha_pattern['v_proj']", "positive"]),
    ({"alpha_pattern": {"v_proj": True}}, ["alpha_pattern['v_proj']", "positive"]),
    # the file's tensors are of rank r everywhere, the config says 4 for q_proj
    ({"rank_pattern": {"q_proj": 4}}, ["self_attn.q_proj.lora_A.weight", "expected [4, ", "rank_pattern"]),
    ({"init_lora_weights": "pissa"}, ["init_lora_weights", "base weights"]),
])
def test_bad_config_fields_refused(tmp_path, config, overrides, needles):
    path = make_peft_dir(tmp_path, config, rank=8, alpha=16, targets="all", seed=6, **overrides)
    refused(path, config, *needles)


def test_rank_above_max_rank_refused(tmp_path, config):
    path = make_peft_dir(tmp_path, config, rank=16, alpha=16, targets=["q"], seed=7)
    refused(path, config, "r must", "[1, 8]", max_rank=8)
    assert load_peft_adapter(path, config, max_rank=16).rank == 16


def test_missing_and_unreadable_files_refused(tmp_path, config):
    refused(tmp_path / "nope", config, "not a directory")
    (tmp_path / "file").write_text("x")
    refused(tmp_path / "file", config, "not a directory")
    good = make_peft_dir(tmp_path / "g", config, rank=4, alpha=4, targets=["q"], seed=8)
    (good / "adapter_config.json").rename(tmp_path / "cfg.json")
    refused(good, config, "adapter_config.json is missing")
    (good / "adapter_config.json").write_text("{not json")
    refused(good, config, "adapter_config.json", "not valid JSON")
    (good / "adapter_config.json").write_text("[1, 2]")
    refused(good, config, "JSON object")
    (tmp_path / "cfg.json").rename(good / "adapter_config.json")
    (good / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    refused(good, config, "adapter_model.safetensors", "cannot be read")
    (good / "adapter_model.safetensors").unlink()
    refused(good, config, "adapter_model.safetensors is missing")


@pytest.mark.parametrize("name", ["adapter_model.bin", "weights.pt", "adapter.pth", "adapter.pkl"])
def test_pickle_only_directory_refused_without_unpickling(tmp_path, config, monkeypatch, name):
    def no_torch_load(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_torch_load)
    path = make_peft_dir(tmp_path, config, rank=4, alpha=4, targets=["q"], seed=9)
    tensors = read_tensors(path)
    (path / "adapter_model.safetensors").unlink()
    torch.save(tensors, path / name)
    refused(path, config, name, "pickle", "safetensors")
    write_tensors(path, tensors)  # with safetensors beside the pickle, the safetensors file is used
    assert load_peft_adapter(path, config).rank == 4


def _edit(path, fn):
    tensors = read_tensors(path)
    fn(tensors)
    write_tensors(path, tensors)


@pytest.mark.parametrize("case", [
    "a_rank", "a_in", "b_out", "b_rank", "int_dtype", "f64_dtype", "nan", "inf", "a_only", "b_only",
    "neither", "untargeted_module", "layer_out_of_range", "layer_not_transformed", "lm_head", "bias_tensor",
    "dora_magnitude", "two_adapter_names",
])
def test_bad_tensors_refused_naming_the_tensor(tmp_path, config, case):
    overrides = {"layers_to_transform": [0]} if case == "layer_not_transformed" else {}
    path = make_peft_dir(tmp_path, config, rank=4, alpha=8, targets=["q", "k", "down"], seed=10, **overrides)
    qa, qb, kb = tensor_key(0, "q", "A"), tensor_key(0, "q", "B"), tensor_key(0, "k", "B")
    h = config.hidden_size
    edits = {
        "a_rank": (qa, lambda t: t.__setitem__(qa, torch.zeros(5, h)), ["shape", "[5, 64]", "[4, 64]"]),
        "a_in": (qa, lambda t: t.__setitem__(qa, torch.zeros(4, h + 1)), ["shape", "[4, 65]"]),
        "b_out": (kb, lambda t: t.__setitem__(kb, torch.zeros(config.q_size, 4)), ["shape", f"[{config.kv_size}, 4]"]),
        "b_rank": (qb, lambda t: t.__setitem__(qb, torch.zeros(config.q_size, 8)), ["shape"]),
        "int_dtype": (qa, lambda t: t.__setitem__(qa, t[qa].to(torch.int32)), ["dtype", "int32"]),
        "f64_dtype": (qa, lambda t: t.__setitem__(qa, t[qa].double()), ["dtype", "float64"]),
        "nan": (qb, lambda t: t[qb].__setitem__((3, 1), float("nan")), ["non-finite"]),
        "inf": (qa, lambda t: t[qa].__setitem__((0, 0), float("inf")), ["non-finite"]),
        "a_only": (qb, lambda t: t.pop(qb), ["missing", "lora_A only"]),
        "b_only": (qa, lambda t: t.pop(qa), ["missing", "lora_B only"]),
        "neither": (qa, lambda t: (t.pop(qa), t.pop(qb)), ["missing", "target_modules"]),
        "untargeted_module": (tensor_key(0, "v", "A"),
                              lambda t: t.__setitem__(tensor_key(0, "v", "A"), torch.zeros(4, h)),
                              ["not in target_modules"]),
        "layer_out_of_range": (tensor_key(5, "q", "A"),
                               lambda t: t.__setitem__(tensor_key(5, "q", "A"), torch.zeros(4, h)),
                               ["layer 5", "2 layers"]),
        "layer_not_transformed": (tensor_key(1, "q", "A"),
                                  lambda t: t.__setitem__(tensor_key(1, "q", "A"), torch.zeros(4, h)),
                                  ["layers_to_transform"]),
        "lm_head": ("base_model.model.lm_head.lora_A.weight",
                    lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(4, h)),
                    ["not a LoRA A/B weight"]),
        "bias_tensor": ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias",
                        lambda t: t.__setitem__("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias",
                                                torch.zeros(config.q_size)), []),
        "dora_magnitude": ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
                           lambda t: t.__setitem__(
                               "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
                               torch.ones(config.q_size)), []),
        "two_adapter_names": (tensor_key(0, "q", "A", "default"),
                              lambda t: t.__setitem__(tensor_key(0, "q", "A", "default"), t[qa].clone()),
                              ["one adapter per file"]),
    }
    key, fn, needles = edits[case]
    _edit(path, fn)
    refused(path, config, repr(key), *needles)


def test_an_adapter_rewritten_while_it_is_read_is_refused(tmp_path, config):
    """A load that overlaps a write of the files could mix two versions whose shapes agree: the files'
    version (inode, size, mtime) is taken before and after the read, and a change refuses the load. A
    writer keeps touching the weights file's mtime, as a write in progress does."""
    path = make_peft_dir(tmp_path / "a", config, rank=8, alpha=16, targets="all", seed=1)
    weights = path / "adapter_model.safetensors"
    version = load_peft_adapter(path, config).version
    assert version == load_peft_adapter(path, config).version  # unchanged files: the same version
    stop = threading.Event()

    def write():
        t = 1_000_000_000
        while not stop.is_set():
            t += 1
            os.utime(weights, ns=(t, t))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(200):  # a read takes far longer than one utime: nearly every load sees a change
            try:
                load_peft_adapter(path, config)
            except AdapterError as e:
                assert "changed while they were read" in e.message
                break
        else:
            pytest.fail("no load saw the files change under it")
    finally:
        stop.set()
        writer.join()
    assert load_peft_adapter(path, config).version != version  # the new mtime is a new version


def test_non_peft_config_json_types(tmp_path, config):
    path = make_peft_dir(tmp_path, config, rank=4, alpha=4, targets=["q"], seed=11)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["lora_alpha"] = True
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    refused(path, config, "lora_alpha")


@pytest.mark.parametrize("patterns", [{}, {"rank_pattern": {"q_proj": 4, "layers.1.mlp.down_proj": 16},
                                          "alpha_pattern": {r"model\.layers\.0\..*": 4, "v_proj": 32}}],
                         ids=["uniform", "rank-and-alpha-patterns"])
def test_real_peft_directory_matches_peft_deltas_and_merge(tmp_path, config, patterns):
    """A directory saved by the peft library loads, and its deltas / merge equal PEFT's own, with per-module
    ranks and alphas read as PEFT reads its patterns."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from loraplex.engine.lora.merge import merged_weights

    torch.manual_seed(0)
    hf = HFLlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                       num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                       head_dim=config.head_dim)
    model = LlamaForCausalLM(hf).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, **patterns))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)  # PEFT starts B at zero; randomize both so deltas are not trivial
    peft_model.save_pretrained(tmp_path)
    lora = load_peft_adapter(tmp_path, config)
    assert (lora.rank, lora.scaling, lora.target_modules) == (16 if patterns else 8, 2.0, ALL)
    if patterns:
        assert (lora.rank_of(0, "q"), lora.rank_of(1, "down"), lora.rank_of(0, "down")) == (4, 16, 8)
        # the first key that matches wins, in the file's order (PEFT writes its config with sorted keys; the
        # keys here are in that order already, so the model in memory agrees): layer 0's v_proj takes 4
        assert [lora.scaling_of(*k) for k in ((1, "v"), (0, "v"), (0, "o"), (1, "o"))] == [4.0, 0.5, 0.5, 2.0]

    short = {p: p.split("_")[0] for p in targets}
    base = {}
    for n, layer in enumerate(peft_model.base_model.model.model.layers):
        mods = {p: getattr(layer.self_attn if i < 4 else layer.mlp, p) for i, p in enumerate(targets)}
        for p, mod in mods.items():
            torch.testing.assert_close(lora.delta(n, short[p]), mod.get_delta_weight("default"), rtol=1e-5, atol=1e-6)
        w = {p: mod.base_layer.weight.detach().clone() for p, mod in mods.items()}
        base[f"layers.{n}.qkv"] = torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]])
        base[f"layers.{n}.o"] = w["o_proj"]
        base[f"layers.{n}.gate_up"] = torch.cat([w["gate_proj"], w["up_proj"]])
        base[f"layers.{n}.down"] = w["down_proj"]
    ours = merged_weights(base, config, lora)
    merged = peft_model.merge_and_unload()
    for n, layer in enumerate(merged.model.layers):
        a, m = layer.self_attn, layer.mlp
        torch.testing.assert_close(ours[f"layers.{n}.qkv"], torch.cat([a.q_proj.weight, a.k_proj.weight,
                                                                       a.v_proj.weight]).detach())
        torch.testing.assert_close(ours[f"layers.{n}.o"], a.o_proj.weight.detach())
        torch.testing.assert_close(ours[f"layers.{n}.gate_up"], torch.cat([m.gate_proj.weight,
                                                                           m.up_proj.weight]).detach())
        torch.testing.assert_close(ours[f"layers.{n}.down"], m.down_proj.weight.detach())
