"""The attention backends by name, and the choice `auto` makes for a device and dtype."""

from __future__ import annotations

import torch

from loraplex.engine.attention.base import AttentionBackend
from loraplex.engine.attention.cpu_c import CpuCBackend
from loraplex.engine.attention.torch_sdpa import TorchSdpaBackend
from loraplex.engine.attention.triton_paged import TritonPagedBackend

BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (TorchSdpaBackend(), CpuCBackend(), TritonPagedBackend())}


def auto_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """triton_paged on CUDA, cpu_c on the CPU with the C kernels, torch_sdpa otherwise."""
    preferred = "triton_paged" if device.type == "cuda" else "cpu_c"
    return preferred if BACKENDS[preferred].unsupported(device, dtype, head_dim) is None else "torch_sdpa"


def attention_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                      kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend `name` (or `auto`'s choice) for a model with a KV cache of `kv_dtype` (None: the model's
    dtype); ValueError, in one line, when it cannot serve them."""
    if name == "auto":
        name = auto_backend(device, dtype, head_dim)
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown attention backend {name!r} (have: auto, {', '.join(BACKENDS)})")
    why = backend.unsupported(device, dtype, head_dim) or backend.unsupported_kv(kv_dtype or dtype, head_dim)
    if why is not None:
        raise ValueError(f"attention backend {name} cannot serve this model: {why}")
    return backend
