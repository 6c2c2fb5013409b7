"""Weight quantization for the GPU's weight GEMMs: symmetric round-to-nearest int8 and FP8 (e4m3).

One place for the math that w8a16.py (int8 weights, 16-bit activations), fp8_linear.py (FP8 weights and
activations) and their references share, so the kernels and the references quantize identically:

    int8   q[n, k] = clamp(round(w[n, k] / s), -127, 127),  s = amax / 127
           per output channel (s[n], amax over row n) or per group of `group_size` columns
           (s[n, g], amax over w[n, g*G:(g+1)*G]); round() is round-half-to-even
    fp8    q[r, k] = e4m3(clamp(w[r, k] / s, -448, 448)),   s = amax / 448
           per row r (a weight's output channel, or an activation's token) or one s for the tensor

An all-zero row (or group) gets s = 1, so dequantization never divides by zero and returns zeros. -127..127
(not -128) keeps int8 symmetric. Scales are fp32. Non-finite inputs are refused: one inf would make a scale
infinite and its whole row NaN.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT8_MAX = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
MIN_GROUP = 16  # the Triton kernel's smallest K block: a group spans whole blocks


def check_float_2d(t: torch.Tensor, name: str, what: str = "weight", finite: bool = True) -> None:
    """Refuses anything but a 2-D fp32/bf16/fp16 tensor, naming it; with `finite`, also inf/NaN (a device sync:
    at load, not per step)."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: cannot quantize a {what} of dtype {t.dtype} (fp32, bf16 or fp16 only)")
    if t.dim() != 2 or t.numel() == 0:
        raise ValueError(f"{name}: a {what} to quantize must be a non-empty 2-D [rows, cols] tensor, "
                         f"got shape {tuple(t.shape)}")
    if finite and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: the {what} holds inf or NaN values; refusing to quantize it")


def check_group_size(group_size: int | None, name: str) -> None:
    """None (per output channel) or a power of two >= MIN_GROUP."""
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < MIN_GROUP \
            or group_size & (group_size - 1):
        raise ValueError(f"{name}: group_size must be None or a power of two >= {MIN_GROUP}, got {group_size!r}")


def _safe(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax / qmax as fp32 scales, 1 where amax is 0."""
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_int8(w: torch.Tensor, group_size: int | None = None, *,
                  name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, scales fp32 [N] or [N, ceil(K / group_size)]) of a weight w [N, K].

    A last, partial group is scaled by its own amax.
    """
    check_float_2d(w, name)
    check_group_size(group_size, name)
    wf = w.float()  # [N, K]
    if group_size is None:
        scales = _safe(wf.abs().amax(dim=1), INT8_MAX)  # [N]
        q = torch.round(wf / scales[:, None])
    else:
        n, k = wf.shape
        groups = -(-k // group_size)
        padded = torch.nn.functional.pad(wf, (0, groups * group_size - k)).view(n, groups, group_size)
        scales = _safe(padded.abs().amax(dim=2), INT8_MAX)  # [N, groups]
        q = torch.round(padded / scales[:, :, None]).view(n, groups * group_size)[:, :k]
    return q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).contiguous(), scales.contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """fp32 [N, K] = q * s, the weight quantize_int8 approximates."""
    if group_size is None:
        return q.float() * scales.float()[:, None]
    return q.float() * scales.float().repeat_interleave(group_size, dim=1)[:, :q.shape[1]]


def quantize_fp8(t: torch.Tensor, per: str = "row", *, scales: torch.Tensor | None = None, name: str = "weight",
                 what: str = "weight", finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [R, K] float8_e4m3fn, scales fp32 [R, 1]) of t [R, K]: one scale per row, or with per="tensor" one
    for the whole tensor (repeated on every row, as torch._scaled_mm's row-wise scaling takes it).

    `scales` (fp32, [R, 1] or one value) replaces the computed ones: a static scale calibrated ahead.
    Values are clamped to +-448 before the cast (a cast beyond e4m3's range gives NaN, not saturation), so
    what lies beyond a given scale's range saturates. finite=False skips the inf/NaN check (activations,
    every step: no device sync).
    """
    if per not in ("row", "tensor"):
        raise ValueError(f"{name}: FP8 scaling must be per 'row' or per 'tensor', got {per!r}")
    check_float_2d(t, name, what, finite)
    tf = t.float()
    if scales is None:
        amax = tf.abs().amax(dim=1, keepdim=True)  # [R, 1]
        if per == "tensor":
            amax = amax.amax().expand_as(amax)
        scales = _safe(amax, FP8_MAX)
    else:
        scales = scales.float().reshape(-1, 1).expand(tf.shape[0], 1)
    scales = scales.contiguous()
    return (tf / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [R, K] = q * s (scales [R, 1] or [R])."""
    return q.float() * scales.float().reshape(-1, 1)
