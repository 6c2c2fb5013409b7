"""What would run the model here with the default options: the device, C kernels or torch ops (and why),
the instruction sets, threads and default dtypes (for `loraplex doctor` and the startup log).

- It imports torch and may build the kernels, so it is not in engine.api (which the platform imports
  cheaply); the answer's type, ComputePath, is, so the platform can carry it (engine stats).
"""

from __future__ import annotations

import torch

from loraplex.engine.api import ComputePath
from loraplex.engine.config import EngineConfig
from loraplex.engine.kernels.cpu import build


def local_compute_path(device: str = "auto") -> ComputePath:
    """Builds (or loads the cached) CPU kernels to say whether they run; on CUDA they do not matter."""
    config = EngineConfig(device=device)
    on_cuda = config.torch_device.type == "cuda"
    model_dtype = _name(config.torch_dtype)
    if on_cuda:
        ops, reason = "cuda", f"{torch.cuda.get_device_name(config.torch_device)} (Triton kernels)"
        built = None
    else:
        status = build.status()
        ops, reason = ("c" if status.loaded else "torch"), status.reason
        built = build.build_instruction_sets() if status.loaded else None
    isa = built if built is not None else build.cpu_instruction_sets()
    return ComputePath(
        device=str(config.torch_device), ops=ops, reason=reason, instruction_sets=isa,
        instruction_sets_of="cpu" if built is None else "build",
        threads=torch.get_num_threads(), model_dtype=model_dtype,
        weight_dtype=f"a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K blocks as stored, other weights {model_dtype}",
        kv_cache_dtype=f"{_name(config.kv_torch_dtype)}; int8 caches smooth K per channel: {config.kv_cache_smoothing}",
        activation_dtype=f"{config.activation_dtype}; int8 over GGUF blocks: {_int8_dot(ops, built)}")


def _int8_dot(ops: str, built: tuple[str, ...] | None) -> str:
    """Which dot product linear_act8.h compiles to in this build, or why int8 activations cannot run."""
    if ops != "c":
        return "not here (CPU C kernels only)" if ops == "cuda" else "not here (needs the C kernels)"
    isa = set(built or ())
    if {"AVX-512F", "AVX-512BW", "AVX-512 VNNI"} <= isa:
        return "AVX-512 VNNI (vpdpbusd)"
    if {"AVX-512F", "AVX-512BW"} <= isa:
        return "AVX-512BW (vpmaddwd)"
    if {"AVX2", "FMA", "F16C"} <= isa and "AVX-512F" not in isa:
        return "AVX-VNNI (vpdpbusd, 256-bit)" if "AVX-VNNI" in isa else "AVX2 (vpmaddwd)"
    return "portable loops"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
