"""The `cpu_c` backend: decode rows through the C kernel, which reads the paged cache in place.

Prefill chunks take torch's SDPA (compute-bound, where SDPA is already good); an all-decode step
runs as the fused C decode step when the model's ops have one (kernels/cpu/decode_step.c), which
does this same attention itself. CPU and fp32 only, with the C kernels built.
"""

from __future__ import annotations

import math

import torch

from loraplex.engine.attention.torch_sdpa import AttentionMetadata, TorchSdpaBackend


class CpuCBackend(TorchSdpaBackend):
    name = "cpu_c"
    dtypes = (torch.float32,)
    fused_decode_step = True

    def unsupported(self, device, dtype, head_dim):
        if device.type != "cpu":
            return f"device {device} (it runs on the CPU)"
        from loraplex.engine.kernels.cpu.layer_ops import layer_ops_available

        if not layer_ops_available():
            return "this machine: the C kernels did not build (see the log)"
        return super().unsupported(device, dtype, head_dim)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata):
        from loraplex.engine.kernels.cpu.layer_ops import decode_attention

        # q: [decodes, heads, head_dim], straight from the paged cache: no K/V gather, no mask
        return decode_attention(q, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, meta.decode_max_len,
                                1.0 / math.sqrt(q.shape[2]))
