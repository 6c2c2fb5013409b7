"""Random-weight models for tests and benchmarks: real shapes, no download, reproducible by seed."""

from __future__ import annotations

import dataclasses

import torch

from loraplex.engine.models.llama import LlamaConfig
from loraplex.engine.models.tokenizer import Tokenizer

_TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
PRESETS: dict[str, LlamaConfig] = {
    "tiny": _TINY,
    "tiny-bias": dataclasses.replace(_TINY, attention_bias=True),  # Qwen2-style q/k/v bias
    # Every projection big enough (64K+ weights) for the CPU kernels to split it between threads.
    "tiny-wide": dataclasses.replace(_TINY, hidden_size=256, intermediate_size=768, head_dim=64),
    # SmolLM2-135M's shapes.
    "small": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    # Llama-3-8B's shapes (8.0B parameters, 16 GB in bf16: made on the GPU, see synthetic_model).
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                             max_position_embeddings=8192, tie_word_embeddings=False),
}

_STD = 0.02


def _is_norm(name: str) -> bool:
    return name == "norm" or name.endswith("_norm")


# Presets up to this many parameters are drawn on the host whatever the device (4 GB in fp32): their values are
# then the same on every device, so a CPU and a GPU engine on "synthetic:small" compare token for token.
HOST_MAX_PARAMS = 1_000_000_000


def synthetic_model(preset: str, seed: int = 0, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None) -> tuple[LlamaConfig, dict[str, torch.Tensor], Tokenizer]:
    """Weights ~ N(0, 0.02) (norms 1.0) for a preset's shapes, on `device` (default the CPU) in `dtype`
    (default fp32).

    - Up to HOST_MAX_PARAMS: drawn on the CPU in fp32, in a fixed order, from one generator seeded with `seed`,
      then cast and moved: the same values for a seed on every device and dtype (tests depend on them).
    - Larger presets on a device other than the CPU: each tensor drawn there, in `dtype`, from its own
      generator on that device seeded from (seed, the tensor's index), so 8B parameters never pass through the
      host. Reproducible on one device type; not the CPU path's values.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown synthetic preset {preset!r} (have: {', '.join(PRESETS)})")
    config = PRESETS[preset]
    device = torch.device(device if device is not None else "cpu")
    dtype = dtype or torch.float32
    if device.type != "cpu" and config.num_params() > HOST_MAX_PARAMS:
        weights = _device_weights(config, seed, device, dtype)
    else:
        weights = _cpu_weights(config, seed)
        if dtype != torch.float32 or device.type != "cpu":
            weights = {name: w.to(device=device, dtype=dtype) for name, w in weights.items()}
    return config, weights, Tokenizer.byte_level(config.vocab_size)


def _cpu_weights(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """fp32, one generator for the whole model in weight_shapes() order (the values tests depend on)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in config.weight_shapes().items():
        if _is_norm(name):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.empty(shape).normal_(0.0, _STD, generator=gen)
    return weights


def _device_weights(config: LlamaConfig, seed: int, device: torch.device,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each tensor made on `device` in `dtype` from a generator seeded from (seed, index): no host copy."""
    weights = {}
    for index, (name, shape) in enumerate(config.weight_shapes().items()):
        if _is_norm(name):
            weights[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            gen = torch.Generator(device=device).manual_seed(seed * 2**20 + index)
            weights[name] = torch.empty(shape, device=device, dtype=dtype).normal_(0.0, _STD, generator=gen)
    return weights
