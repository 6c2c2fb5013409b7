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
}


def synthetic_model(preset: str, seed: int = 0) -> tuple[LlamaConfig, dict[str, torch.Tensor], Tokenizer]:
    """Weights ~ N(0, 0.02) (norms 1.0) drawn in a fixed order from a generator seeded with `seed`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown synthetic preset {preset!r} (have: {', '.join(PRESETS)})")
    config = PRESETS[preset]
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in config.weight_shapes().items():
        if name == "norm" or name.endswith("_norm"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
    return config, weights, Tokenizer.byte_level(config.vocab_size)
