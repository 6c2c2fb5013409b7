"""W8A16: a Triton GEMM over int8 weights and 16-bit (or fp32) activations, dequantized in registers.

A decode step at small batches streams every weight once, so int8 weights read half the bytes of bf16.
Each program computes one [BLOCK_M, BLOCK_N] tile of y: it loads int8 weight tiles, widens them to x's
dtype (exact: |q| <= 127) and multiplies on tensor cores with fp32 accumulation; the per-channel scale is
applied once to the accumulated tile, a per-group scale to each K block's product (a group spans whole
blocks). Small M leaves few tiles for a large GPU, so the K reduction can be split over programs that
add atomically into an fp32 buffer (split_k). Quantization: quant.py; reference: quant_ref.py.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex.engine.kernels.launch import on_device
from loraplex.engine.kernels.quant import FLOAT_DTYPES, check_group_size
from loraplex.engine.kernels.sgmv import check_blocks, check_triton_device, dot_config, pow2_block
from loraplex.engine.kernels.split_k import k_range, store_split

MAX_SPLIT_K = 8
MIN_K_PER_SPLIT = 512  # no split leaves a program fewer K columns than this


@triton.jit
def _w8a16_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                  GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = k_range(pid_k, K, SPLIT_K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        qt = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None],
                     mask=mask_n[None, :] & mask_k[:, None], other=0)  # [BLOCK_K, BLOCK_N] = q^T tile, int8
        if UPCAST:
            xt, wt = xt.to(tl.float32), qt.to(tl.float32)
        else:
            wt = qt.to(xt.dtype)
        part = tl.dot(xt, wt, input_precision=PRECISION)
        if GROUP > 0:
            s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP, mask=mask_n, other=0.0)  # [BLOCK_N]
            acc += part * s[None, :]
        else:
            acc += part
    if GROUP == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:  # once: by the first K split
        first = (pid_k == 0).to(tl.float32)
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :] * first
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    store_split(y_ptrs, acc, mask, SPLIT_K)


def check_w8a16(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                group_size: int | None, name: str) -> None:
    """Refuses what the kernel cannot take, naming the tensor (`name` is the weight's)."""
    check_group_size(group_size, name)
    if q.dtype != torch.int8 or q.dim() != 2 or q.stride(1) != 1:
        raise ValueError(f"{name}: an int8 weight must be an int8 [out, in] tensor with contiguous rows, "
                         f"got {q.dtype} of shape {tuple(q.shape)} and strides {q.stride()}")
    n, k = q.shape
    groups = None if group_size is None else -(-k // group_size)
    want = (n,) if groups is None else (n, groups)
    if scales.dtype != torch.float32 or tuple(scales.shape) != want or not scales.is_contiguous():
        raise ValueError(f"{name}.scales: expected contiguous fp32 of shape {want}, "
                         f"got {scales.dtype} of shape {tuple(scales.shape)}")
    if x.dtype not in FLOAT_DTYPES or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{name}: input x must be fp32/bf16/fp16 [tokens, {k}] with contiguous rows, "
                         f"got {x.dtype} of shape {tuple(x.shape)}")
    if bias is not None and (bias.dtype not in FLOAT_DTYPES or tuple(bias.shape) != (n,)):
        raise ValueError(f"{name}.bias: expected a float tensor of shape ({n},), "
                         f"got {bias.dtype} of shape {tuple(bias.shape)}")
    for what, t in (("weight", q), ("scales", scales), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: {what} is on {t.device} but x is on {x.device}")


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_split_k(programs: int, k: int, block_k: int, device: torch.device) -> int:
    """Doubles the K split while the grid stays within two programs per SM and every split keeps
    MIN_K_PER_SPLIT columns (CUDA only; 1 in the interpreter)."""
    if device.type != "cuda":
        return 1
    room = 2 * _sm_count(device)
    split = 1
    while split < MAX_SPLIT_K and programs * split * 2 <= room and k // (split * 2) >= max(MIN_K_PER_SPLIT, block_k):
        split *= 2
    return split


def w8a16_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
                 group_size: int | None = None, split_k: int | None = None, block_m: int | None = None,
                 block_n: int | None = None, block_k: int | None = None, name: str = "weight") -> torch.Tensor:
    """y = x @ (q * s)^T + bias, int8 weights dequantized in registers.

    Semantics:
        x [M, K] (fp32/bf16/fp16, rows contiguous), q [N, K] int8 (rows contiguous),
        scales fp32 [N] (per output channel) or [N, ceil(K / group_size)] (per group of group_size columns),
        bias [N] float or None. With s(n, k) = scales[n] or scales[n, k // group_size]:
            y[m, n] = sum_k x[m, k] * q[n, k] * s(n, k) + bias[n]
        q is widened to x's dtype (exact), products are summed in fp32 (per channel: s applied to the sum;
        per group: to each K block's sum), the bias is added in fp32, and y [M, N] has x's dtype, rounded
        once (split_k > 1: the fp32 partial sums are added atomically, then rounded once).
    split_k None = auto (CUDA: until about two programs per SM; interpreter: 1). name labels refusals.
    """
    check_w8a16(x, q, scales, bias, group_size, name)
    check_triton_device(x)
    m, k = x.shape
    n = q.shape[0]
    if m == 0:
        return x.new_empty(0, n)
    bm = block_m or pow2_block(m, 16, 64)
    bn = block_n or (64 if m > 16 else 32)
    bk = block_k or min(128, pow2_block(k, 16, 128), group_size or 128)
    check_blocks(block_m=bm, block_n=bn, block_k=bk)
    if group_size is not None and group_size % bk:
        raise ValueError(f"{name}: block_k {bk} must divide group_size {group_size}")
    grid_mn = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    split = split_k or auto_split_k(grid_mn[0] * grid_mn[1], k, bk, x.device)
    if not 1 <= split <= MAX_SPLIT_K:
        raise ValueError(f"split_k must be in 1..{MAX_SPLIT_K}, got {split}")
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split > 1 else x.new_empty(m, n)
    precision, upcast = dot_config(x.dtype)
    with on_device(x):
        _w8a16_kernel[(*grid_mn, split)](
            x, q, scales, bias if bias is not None else scales, y, m, n, k,
            x.stride(0), q.stride(0), scales.stride(0), y.stride(0),
            GROUP=group_size or 0, HAS_BIAS=bias is not None, SPLIT_K=split, PRECISION=precision, UPCAST=upcast,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.to(x.dtype) if split > 1 else y
