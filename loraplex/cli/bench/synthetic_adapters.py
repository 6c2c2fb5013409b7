"""Random PEFT LoRA adapters for a base model's shapes, written as PEFT saves them (adapter_config.json
and adapter_model.safetensors), so that benchmarks can register real adapters without PEFT installed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def model_config(model: str):
    """The base model's config (hidden size, heads, layers), as the engine loads it."""
    from loraplex.engine.models.loader import load_model, resolve_model

    return load_model(resolve_model(model)).config


def _dims(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(path: Path, config, rank: int = 8, seed: int = 0) -> Path:
    """A rank-`rank` adapter on every projection of every layer, with random weights from `seed`."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for proj, (d_in, d_out) in _dims(config).items():
            parent = "self_attn" if proj in _ATTN else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
           "target_modules": [*_ATTN, *_MLP], "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
           "use_dora": False, "base_model_name_or_path": "synthetic"}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path
