"""FP8 (e4m3) weight GEMMs through torch._scaled_mm, on CUDA devices of compute capability 8.9 and up.

- Why: Ada and Hopper multiply e4m3 operands on tensor cores at twice bf16's rate and read half its bytes.
- The weight is quantized once (quant.quantize_fp8, one scale per output channel); the activations on the fly, per
  token (default) or per tensor; torch._scaled_mm applies both scales to the fp32 sums (row-wise scaling).
- A torch without row-wise scaling on this card (before ~2.5 on Hopper, ~2.7 on Ada) gets the same math from a
  tensor-wise call with unit scales and the scales applied to its fp32 output.
- Anywhere else fp8_linear refuses with the reason (fp8_unsupported).
- quant_ref.ref_fp8_linear is the reference the tests compare against.
"""

from __future__ import annotations

import torch

from loraplex.engine.kernels.quant import FLOAT_DTYPES, FP8_DTYPE, quantize_fp8

MIN_CAPABILITY = (8, 9)
ALIGN = 16  # torch._scaled_mm: the weight's both dimensions (K and N) multiples of this
ACT_SCALES = {"token": "row", "tensor": "tensor"}  # act_scale -> quantize_fp8's `per`
_ROWWISE: dict[torch.device, bool] = {}  # per device: does torch._scaled_mm take row-wise scales there


def fp8_unsupported(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on `device` (a sentence), or None when they can."""
    if device.type != "cuda":
        return f"FP8 GEMMs run on CUDA only, not on {device}"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return f"compute capability {major}.{minor} < 8.9: no FP8 tensor cores on this card"
    return None


def check_fp8_weight(q: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """Refuses an FP8 weight torch._scaled_mm cannot take, naming it."""
    if q.dtype != FP8_DTYPE or q.dim() != 2 or not q.is_contiguous():
        raise ValueError(f"{name}: an FP8 weight must be a contiguous float8_e4m3fn [out, in] tensor, "
                         f"got {q.dtype} of shape {tuple(q.shape)}")
    n, k = q.shape
    if n % ALIGN or k % ALIGN:
        raise ValueError(f"{name}: FP8 weights need out and in features divisible by {ALIGN} "
                         f"(torch._scaled_mm), got [{n}, {k}]")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (n, 1) or not scales.is_contiguous():
        raise ValueError(f"{name}.scales: expected contiguous fp32 of shape ({n}, 1), "
                         f"got {scales.dtype} of shape {tuple(scales.shape)}")


def scaled_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """(xq * sx) @ (wq * sw)^T with fp32 sums: xq [M, K] and wq [N, K] e4m3, sx [M, 1] and sw [N, 1] fp32;
    returns [M, N] bf16 (row-wise scaling), or fp32 (the tensor-wise fallback). No checks: fp8_linear's."""
    b = wq.t()  # [K, N] column-major, as _scaled_mm wants its second operand
    if _ROWWISE.get(xq.device, True):
        try:
            out = torch._scaled_mm(xq, b, scale_a=sx, scale_b=sw.view(1, -1), out_dtype=torch.bfloat16)
            _ROWWISE[xq.device] = True
            return out[0] if isinstance(out, tuple) else out  # (torch < 2.4 returned (out, amax))
        except RuntimeError:
            if _ROWWISE.get(xq.device):
                raise  # it worked here before: a real error
            _ROWWISE[xq.device] = False
    one = torch.ones((), dtype=torch.float32, device=xq.device)
    out = torch._scaled_mm(xq, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    out = out[0] if isinstance(out, tuple) else out
    return out.mul_(sx).mul_(sw.view(1, -1))


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
               act_scale: str = "token", name: str = "weight") -> torch.Tensor:
    """y = x @ (q * s)^T + bias with FP8 weights and activations (torch._scaled_mm, sm89+).

    Semantics:
        x [M, K] (fp32/bf16/fp16), q [N, K] float8_e4m3fn, scales [N, 1] fp32 (quant.quantize_fp8), bias [N]
        or None; N and K multiples of 16. The activations are quantized as quant.quantize_fp8 does:
        xq, sx = quantize_fp8(x, per="row" if act_scale == "token" else "tensor"), then
            y[m, n] = sum_k xq[m, k] * q[n, k] * sx[m] * scales[n] + bias[n]
        with fp32 sums, rounded to bf16 (row-wise path) and returned in x's dtype, bias added there.
    Raises RuntimeError where torch._scaled_mm cannot run FP8 (fp8_unsupported says why).
    """
    check_fp8_weight(q, scales, name)
    if act_scale not in ACT_SCALES:
        raise ValueError(f"{name}: act_scale must be one of {', '.join(ACT_SCALES)}, got {act_scale!r}")
    if x.dtype not in FLOAT_DTYPES or x.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"{name}: input x must be fp32/bf16/fp16 [tokens, {q.shape[1]}], "
                         f"got {x.dtype} of shape {tuple(x.shape)}")
    if bias is not None and (bias.dtype not in FLOAT_DTYPES or tuple(bias.shape) != (q.shape[0],)):
        raise ValueError(f"{name}.bias: expected a float tensor of shape ({q.shape[0]},), "
                         f"got {bias.dtype} of shape {tuple(bias.shape)}")
    reason = fp8_unsupported(x.device)
    if reason:
        raise RuntimeError(f"{name}: cannot run an FP8 weight here: {reason}")
    if q.device != x.device:
        raise ValueError(f"{name}: the weight is on {q.device} but x is on {x.device}")
    if x.shape[0] == 0:
        return x.new_empty(0, q.shape[0])
    xq, sx = quantize_fp8(x, ACT_SCALES[act_scale], name=name, what="input x", finite=False)
    y = scaled_mm(xq, sx, q, scales).to(x.dtype)
    return y if bias is None else y.add_(bias.to(x.dtype))
