"""Hugging Face model directory -> LlamaConfig, fused weights, Tokenizer.

Reads only config.json, *.safetensors and the tokenizer files; pickled `.bin` checkpoints are
refused, since unpickling runs arbitrary code from the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.engine.models.llama import LlamaConfig, rope_inv_freq
from loraplex.engine.models.registry import family_for_hf
from loraplex.engine.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaConfig, dict, Tokenizer]:
    path = Path(path)
    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path}: unreadable model config ({e})") from e
    config = hf_config(raw, source=str(path))
    weights = hf_weights(path, config, dtype)
    return config, weights, Tokenizer.from_hf_dir(path)


def hf_config(raw: dict, source: str = "config.json") -> LlamaConfig:
    """LlamaConfig from a transformers config.json (both the 4.x `rope_theta`/`rope_scaling`
    keys and the 5.x `rope_parameters` dict)."""
    arch = (raw.get("architectures") or [None])[0]
    family = family_for_hf(arch, source)  # (refuses an unknown one, naming the supported ones)
    if raw.get("hidden_act", "silu") != "silu" or raw.get("mlp_bias"):
        raise ValueError(f"{source}: only SiLU MLPs without bias are supported")
    heads = raw["num_attention_heads"]
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    max_pos = raw.get("max_position_embeddings", 4096)
    window = raw.get("sliding_window") if raw.get("use_sliding_window", arch != "Qwen2ForCausalLM") else None
    if window and window < max_pos:
        # Attention here is full-context; capping the context keeps it exact (Mistral v0.1).
        log.warning("%s: sliding window %d < context %d; context capped to the window",
                    source, window, max_pos)
        max_pos = window
    config = LlamaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", family.qkv_bias_default)),
        rope_scaling=dict(scaling) if scaling else None,
        architecture=family.architecture,
    )
    try:
        rope_inv_freq(config)  # refuse unsupported rope scaling now, not when the model is built
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    return config


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(p for p in path.glob("model*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ValueError(f"{path}: only pickled weights (.bin/.pt) found; convert them to safetensors")
    raise ValueError(f"{path}: no *.safetensors weights")


def hf_weights(path: Path, config: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fused q|k|v (+ bias) and gate|up in internal naming, cast to `dtype`."""
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in _weight_files(path)]
        where = {key.removeprefix("model."): (h, key) for h in handles for key in h.keys()}  # noqa: SIM118
        return _fuse(path, config, dtype, where)


def _fuse(path: Path, config: LlamaConfig, dtype: torch.dtype, where: dict) -> dict[str, torch.Tensor]:

    def w(name: str) -> torch.Tensor:
        if name not in where:
            raise ValueError(f"{path}: weight {name!r} missing")
        h, key = where[name]
        return h.get_tensor(key).to(dtype)

    out = {"embed": w("embed_tokens.weight"), "norm": w("norm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head"] = w("lm_head.weight")
    for i in range(config.num_layers):
        p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out[p + "input_norm"] = w(p + "input_layernorm.weight")
        out[p + "qkv"] = torch.cat([w(a + f"{x}_proj.weight") for x in "qkv"])  # [q + 2 kv, hidden]
        if config.attention_bias:
            out[p + "qkv_bias"] = torch.cat([w(a + f"{x}_proj.bias") for x in "qkv"])
        out[p + "o"] = w(a + "o_proj.weight")
        out[p + "post_norm"] = w(p + "post_attention_layernorm.weight")
        # gate_up: [2 * intermediate, hidden]
        out[p + "gate_up"] = torch.cat([w(m + "gate_proj.weight"), w(m + "up_proj.weight")])
        out[p + "down"] = w(m + "down_proj.weight")
    return out
