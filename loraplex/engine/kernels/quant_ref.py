"""Plain torch references for the quantized weight GEMMs (w8a16.py, fp8_linear.py): dequantize, then one
fp32 matmul on the CPU. Quantization itself is quant.py's (tested on its own), so a reference and its kernel
see the same quantized values and differ only in how they sum.
"""

from __future__ import annotations

import torch

from loraplex.engine.kernels.fp8_linear import ACT_SCALES
from loraplex.engine.kernels.quant import dequantize_fp8, dequantize_int8, quantize_fp8


def _affine(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T + bias, fp32 on the CPU -> [M, N]."""
    y = x.float().cpu() @ w.float().cpu().T
    return y if bias is None else y + bias.float().cpu()


def ref_w8a16_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                     group_size: int | None = None) -> torch.Tensor:
    """y[m, n] = sum_k x[m, k] * q[n, k] * s(n, k) + bias[n] in fp32 -> [M, N] fp32 (CPU)."""
    return _affine(x, dequantize_int8(q.cpu(), scales.cpu(), group_size), bias)


def ref_fp8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                   act_scale: str = "token") -> torch.Tensor:
    """The activations quantized as fp8_linear does, then y = dq(x) @ dq(w)^T + bias in fp32 -> [M, N] (CPU)."""
    xq, sx = quantize_fp8(x.cpu(), ACT_SCALES[act_scale], what="input x")
    return _affine(dequantize_fp8(xq, sx), dequantize_fp8(q.cpu(), scales.cpu()), bias)
