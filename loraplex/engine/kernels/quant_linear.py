"""Quantized projection weights as a model's ops take them: int8 (W8A16 Triton kernel) or FP8 (torch._scaled_mm).

`quantize(w, kind)` once at load (what an ops class's `prepare` would return), `linear(x, qw, bias)` per call
(its `linear`). Math and refusals: quant.py, w8a16.py, fp8_linear.py.

- int8: Triton on CUDA, or in the interpreter (TRITON_INTERPRET=1, the tests); elsewhere (a CPU without the
  interpreter) the weight is dequantized to x's dtype on every call and F.linear runs: correct, not fast.
- fp8: CUDA, compute capability 8.9+ only; elsewhere linear refuses with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.engine.kernels.fp8_linear import ACT_SCALES, ALIGN, fp8_linear
from loraplex.engine.kernels.lora_ops import triton_available
from loraplex.engine.kernels.quant import dequantize_fp8, dequantize_int8, quantize_fp8, quantize_int8
from loraplex.engine.kernels.w8a16 import w8a16_linear

KINDS = ("int8", "fp8")


@dataclass(frozen=True)
class QuantizedLinearWeight:
    """A projection weight [out, in] in its quantized form, with what `linear` needs to use it."""

    kind: str  # "int8" | "fp8"
    data: torch.Tensor  # [out, in] int8 / float8_e4m3fn
    scales: torch.Tensor  # fp32: int8 [out] or [out, ceil(in / group_size)]; fp8 [out, 1]
    group_size: int | None = None  # int8 only: columns per scale (None: one scale per output channel)
    act_scale: str = "token"  # fp8 only: the activations' scales, per "token" or per "tensor"
    name: str = "weight"  # named in refusals

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Resident bytes: the quantized values and their scales."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] these values stand for."""
        if self.kind == "int8":
            return dequantize_int8(self.data, self.scales, self.group_size)
        return dequantize_fp8(self.data, self.scales)

    def to(self, device: torch.device | str) -> QuantizedLinearWeight:
        return QuantizedLinearWeight(self.kind, self.data.to(device), self.scales.to(device), self.group_size,
                                     self.act_scale, self.name)


def quantize(w: torch.Tensor, kind: str, *, group_size: int | None = None, act_scale: str = "token",
             name: str = "weight") -> QuantizedLinearWeight:
    """w [out, in] (fp32/bf16/fp16, finite) quantized as `kind`, on w's device; refusals name `name`."""
    if kind == "int8":
        q, s = quantize_int8(w, group_size, name=name)
        return QuantizedLinearWeight(kind, q, s, group_size, name=name)
    if kind != "fp8":
        raise ValueError(f"{name}: unknown quantized weight kind {kind!r} (one of {', '.join(KINDS)})")
    if group_size is not None:
        raise ValueError(f"{name}: FP8 weights have one scale per output channel; group_size must be None")
    if act_scale not in ACT_SCALES:
        raise ValueError(f"{name}: act_scale must be one of {', '.join(ACT_SCALES)}, got {act_scale!r}")
    if w.dim() == 2 and (w.shape[0] % ALIGN or w.shape[1] % ALIGN):
        raise ValueError(f"{name}: FP8 weights need out and in features divisible by {ALIGN} "
                         f"(torch._scaled_mm), got {list(w.shape)}")
    q, s = quantize_fp8(w, "row", name=name)
    return QuantizedLinearWeight(kind, q, s, act_scale=act_scale, name=name)


def linear(x: torch.Tensor, qw: QuantizedLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T + bias -> [..., out] in x's dtype, W the weight qw stands for."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)  # [tokens, in]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if qw.kind == "int8":
        if triton_available(x.device):
            y = w8a16_linear(x2, qw.data, qw.scales, bias, group_size=qw.group_size, name=qw.name)
        else:
            y = F.linear(x2, qw.dequantize().to(x.dtype), None if bias is None else bias.to(x.dtype))
    elif qw.kind == "fp8":
        y = fp8_linear(x2, qw.data, qw.scales, bias, act_scale=qw.act_scale, name=qw.name)
    else:
        raise ValueError(f"{qw.name}: unknown quantized weight kind {qw.kind!r} (one of {', '.join(KINDS)})")
    return y.reshape(*lead, qw.shape[0])
