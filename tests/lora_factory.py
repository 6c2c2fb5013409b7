"""Writes synthetic PEFT LoRA directories for tests, laid out as PEFT saves them for Llama.

Kept independent of loraplex.engine.lora (shapes are computed here) so the loader is tested against
an outside description of the format. Deltas are random and large enough (entries ~ `magnitude`, the
base weights being ~0.02) that adapters change greedy outputs of the synthetic models.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MISSING = object()  # an override with this value deletes the key from adapter_config.json
PROJ = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
        "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ALL_TARGETS = tuple(PROJ)
WEIGHTS = "adapter_model.safetensors"


def _dims(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) per short module name."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def tensor_key(layer: int, module: str, ab: str, adapter_name: str | None = None) -> str:
    """The safetensors key PEFT writes for `module` ("q" or "q_proj") of `layer`, ab = "A" or "B"."""
    proj = PROJ.get(module, module)
    parent = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    infix = f".{adapter_name}" if adapter_name else ""
    return f"base_model.model.model.layers.{layer}.{parent}.{proj}.lora_{ab}{infix}.weight"


def make_peft_dir(path: str | Path, config, rank: int, alpha: float, targets: Iterable[str] | str, seed: int,
                  dtype: torch.dtype = torch.float32, use_rslora: bool = False, *, magnitude: float = 0.05,
                  adapter_name: str | None = None, ranks: Callable[[int, str], int] | None = None,
                  **overrides) -> Path:
    """Writes adapter_config.json and adapter_model.safetensors under `path` (created) and returns it.

    targets: short ("q") or PEFT ("q_proj") names, or "all". overrides replace adapter_config.json
    fields (MISSING deletes one); a `layers_to_transform` override also limits which layers get tensors.
    A ~ N(0, 1/in), B scaled so that scaling * B @ A has entries of std `magnitude`. `ranks(layer, short
    name)`: each module's rank in the file (default `rank`), to go with a rank_pattern override.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = ALL_TARGETS if targets == "all" else tuple(targets)
    short = [next((s for s, p in PROJ.items() if p == n), n) for n in names]
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "synthetic",
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": [PROJ[s] for s in short],
        "bias": "none", "fan_in_fan_out": False, "use_rslora": use_rslora, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True, "inference_mode": True,
    }
    for key, value in overrides.items():
        if value is MISSING:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    layers = cfg.get("layers_to_transform")
    if layers is None:
        layers = range(config.num_layers)
    elif isinstance(layers, int):
        layers = [layers]
    gen = torch.Generator().manual_seed(seed)
    dims = _dims(config)
    tensors = {}
    for layer in layers:
        if not (isinstance(layer, int) and 0 <= layer < config.num_layers):
            continue  # an out-of-range override is for the config check; write nothing for it
        for m in short:
            in_f, out_f = dims[m]
            r = ranks(layer, m) if ranks is not None else rank
            a = torch.randn(r, in_f, generator=gen) / math.sqrt(in_f)
            b = torch.randn(out_f, r, generator=gen) * magnitude * math.sqrt(in_f) / (scaling * math.sqrt(r))
            tensors[tensor_key(layer, m, "A", adapter_name)] = a.to(dtype).contiguous()
            tensors[tensor_key(layer, m, "B", adapter_name)] = b.to(dtype).contiguous()
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return path


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / WEIGHTS))


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(path) / WEIGHTS), metadata={"format": "pt"})
