"""SGMV: segmented gather matrix-vector (really matrix-matrix) LoRA kernels for prefill-shaped batches.

Tokens are grouped in segments that share one adapter slot (seg_starts [G+1], seg_slots [G], -1 =
skip the segment); each program computes one tile of one segment, so a long segment is a real GEMM
against its adapter's weights, read once per tile. Layout of A and B: see lora_ops.py. The weights may
have another dtype than the activations (EngineConfig.lora_dtype): both are then upcast to fp32 in the
tile, which is exact.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from loraplex.engine.kernels.launch import on_device
from loraplex.engine.kernels.lora_ops import (
    MAX_SLICES,
    check_a,
    check_expand,
    check_segments,
    check_x,
    check_y,
    triton_available,
)
from loraplex.engine.kernels.split_k import adapter_rank, k_range, store_split


@triton.jit
def slice_bounds(s, w0, w1, w2, w3):
    """(column offset, width) of slice s of a fused output with slice widths w0..w3 (unused = 0)."""
    off = (s > 0).to(tl.int32) * w0 + (s > 1).to(tl.int32) * w1 + (s > 2).to(tl.int32) * w2
    width = tl.where(s == 0, w0, tl.where(s == 1, w1, tl.where(s == 2, w2, w3)))
    return off, width


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, y_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr,
                        in_features, r_max, n_blocks, num_slices,
                        stride_xm, stride_as, stride_ar, stride_ym,
                        HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)  # (m block, slice, n block within the slice)
    seg = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    if slot < 0:
        return
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    pid_m = pid // (num_slices * n_blocks)
    s = (pid // n_blocks) % num_slices
    nb = pid % n_blocks
    m0 = start + pid_m * BLOCK_M
    if m0 >= end:
        return
    rank = adapter_rank(ranks_ptr, slot, r_max, HAS_RANKS)
    if nb * BLOCK_N >= rank:
        return  # all-padding columns: y was zero-filled
    offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_r = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < end
    mask_r = offs_r < rank
    a_rows = s * r_max + offs_r
    k_start, k_end = k_range(pid_k, in_features, SPLIT_K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_ptr + slot * stride_as + a_rows[None, :] * stride_ar + offs_k[:, None],
                     mask=mask_r[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] = A^T tile
        if UPCAST:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision=PRECISION)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + a_rows[None, :]
    mask = mask_m[:, None] & mask_r[None, :]
    store_split(y_ptrs, acc, mask, SPLIT_K)


@triton.jit
def _sgmv_expand_kernel(y_ptr, b_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr,
                        w0, w1, w2, w3, r_max, n_blocks, stride_ym, stride_bs, stride_bn, stride_bk, stride_om,
                        HAS_RANKS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                        Y_AS_B: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)  # (m block, n block within the slice)
    seg = tl.program_id(1)
    s = tl.program_id(2)  # slice
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    if slot < 0:
        return
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    m0 = start + (pid // n_blocks) * BLOCK_M
    n0 = (pid % n_blocks) * BLOCK_N
    off, width = slice_bounds(s, w0, w1, w2, w3)
    if m0 >= end or n0 >= width:
        return
    rank = adapter_rank(ranks_ptr, slot, r_max, HAS_RANKS)
    offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < end
    mask_n = offs_n < width
    cols = off + offs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < rank
        yt = tl.load(y_ptr + offs_m[:, None] * stride_ym + (s * r_max + offs_k)[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        bt = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                     mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] = B^T tile
        if Y_AS_B:
            yt = yt.to(bt.dtype)  # tensor-core operands; exact for fp32
        if UPCAST:
            yt, bt = yt.to(tl.float32), bt.to(tl.float32)
        acc += tl.dot(yt, bt, input_precision=PRECISION)
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + cols[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + acc).to(o.dtype), mask=mask)


# ---------------------------------------------------------------------- launch helpers (SGMV and BGMV)

def check_triton_device(t: torch.Tensor) -> None:
    if not triton_available(t.device):
        raise ValueError(f"Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1), got device {t.device}")


def check_blocks(**blocks: int) -> None:
    for name, b in blocks.items():
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")


def pow2_block(n: int, lo: int = 16, hi: int = 64) -> int:
    """The power of two covering n, clamped to [lo, hi]."""
    return max(lo, min(hi, 1 << max(n - 1, 0).bit_length()))


def padded_widths(widths: tuple[int, ...]) -> tuple[int, ...]:
    """Slice widths as the kernels' fixed MAX_SLICES scalar arguments (unused slices 0)."""
    return widths + (0,) * (MAX_SLICES - len(widths))


def dot_config(dtype: torch.dtype, activations: torch.dtype | None = None) -> tuple[str, bool]:
    """(tl.dot input precision, upcast operands to fp32 first) for weights of this dtype.

    fp32 is exact ("ieee", no TF32 rounding); bf16/fp16 run on tensor cores with fp32 accumulation.
    The interpreter (TRITON_INTERPRET=1) multiplies bf16 bit patterns in tl.dot (it stores bf16 as
    uint16; triton-lang/triton#11584), so there bf16 tiles are upcast to fp32 first, which gives the
    same products as a tensor core does. Weights of another dtype than the `activations` (16-bit slots
    under an fp32 model, or the reverse) are upcast with them, and multiplied exactly.
    """
    if activations is not None and activations != dtype:
        return "ieee", True
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return "ieee", True
    return ("ieee" if dtype == torch.float32 else "tf32"), False


def _max_seg_len(seg_starts: torch.Tensor, max_seg_len: int | None) -> int:
    if max_seg_len is not None:
        return int(max_seg_len)
    return int((seg_starts[1:] - seg_starts[:-1]).max()) if seg_starts.numel() > 1 else 0  # host sync


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, *,
                num_slices: int = 1, max_seg_len: int | None = None, ranks: torch.Tensor | None = None,
                y: torch.Tensor | None = None, split_k: int = 1, block_m: int | None = None,
                block_n: int | None = None, block_k: int | None = None,
                check_values: bool | None = None) -> torch.Tensor:
    """SGMV shrink: project each segment's tokens onto its adapter's low-rank space.

    Semantics:
        x [T, in] (fp32/bf16/fp16), lora_a [num_slots, S*r_max, in] (fp32/bf16/fp16: x's dtype, or
        another, when both are upcast to fp32),
        seg_starts [G+1] int (0 = seg_starts[0] <= .. <= seg_starts[G] = T), seg_slots [G] int,
        ranks [num_slots] int or None (None = every slot has rank r_max).
        For every segment g with slot = seg_slots[g] >= 0, token t in [seg_starts[g], seg_starts[g+1]),
        slice s < S and k < r_max:
            y[t, s*r_max + k] = sum_i x[t, i] * A[slot, s*r_max + k, i]   if k < ranks[slot]
                              = 0                                          otherwise
        Rows of segments with slot -1 are 0. Accumulation is fp32 and y is fp32 [T, S*r_max]
        (returned; pass y= to reuse a buffer, which is zero-filled here).
    max_seg_len (longest segment) sizes the grid; None reads it from seg_starts (a device sync).
    split_k > 1 splits the in_features reduction over programs that atomically add into y.
    """
    r_max = check_a(lora_a, num_slices, ranks)
    check_x(x, lora_a)
    check_triton_device(x)
    check_segments(seg_starts, seg_slots, x.shape[0], lora_a.shape[0], x.device, check_values)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    if y is None:
        y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    else:
        check_y(y, x.shape[0], lora_a.shape[1], x.device)
        y.zero_()
    longest = _max_seg_len(seg_starts, max_seg_len)
    if longest == 0 or seg_slots.numel() == 0:
        return y
    bm = block_m or pow2_block(longest, 16, 64)
    bn = block_n or pow2_block(r_max, 16, 64)
    bk = block_k or pow2_block(x.shape[1], 16, 128)
    check_blocks(block_m=bm, block_n=bn, block_k=bk)
    n_blocks = triton.cdiv(r_max, bn)
    precision, upcast = dot_config(lora_a.dtype, x.dtype)
    grid = (triton.cdiv(longest, bm) * num_slices * n_blocks, seg_slots.shape[0], split_k)
    with on_device(x):
        _sgmv_shrink_kernel[grid](
            x, lora_a, y, seg_starts, seg_slots, ranks if ranks is not None else seg_slots,
            x.shape[1], r_max, n_blocks, num_slices,
            x.stride(0), lora_a.stride(0), lora_a.stride(1), y.stride(0),
            HAS_RANKS=ranks is not None, SPLIT_K=split_k, PRECISION=precision, UPCAST=upcast,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y


def sgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, *, slice_widths: Sequence[int] | None = None,
                max_seg_len: int | None = None, ranks: torch.Tensor | None = None,
                block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                check_values: bool | None = None) -> None:
    """SGMV expand: add each segment's LoRA delta to the base projection output, in place, all slices at once.

    Semantics:
        y [T, S*r_max] fp32, lora_b [num_slots, out_total, r_max] (contiguous or rank-major, any strides
        work), out [T, out_total] (fp32/bf16/fp16),
        slice_widths (w_0..w_{S-1}) summing to out_total (None = S equal slices), off_s = w_0+..+w_{s-1}.
        For every segment g with slot = seg_slots[g] >= 0, token t in it, slice s and n < w_s:
            out[t, off_s + n] += sum_{k < rank} y[t, s*r_max + k] * B[slot, off_s + n, k]
        with rank = min(ranks[slot], r_max) (r_max without ranks). When out has B's dtype the dot runs
        on y cast to it, with fp32 accumulation; else on y and B in fp32. The add is in fp32, rounded
        once to out's dtype.
        Rows of segments with slot -1 are not touched.
    """
    num_slices, r_max, widths = check_expand(y, lora_b, out, slice_widths, ranks)
    check_triton_device(out)
    check_segments(seg_starts, seg_slots, out.shape[0], lora_b.shape[0], out.device, check_values)
    longest = _max_seg_len(seg_starts, max_seg_len)
    if longest == 0 or seg_slots.numel() == 0:
        return
    bm = block_m or pow2_block(longest, 16, 64)
    bn = block_n or pow2_block(max(widths), 16, 128)
    bk = block_k or pow2_block(r_max, 16, 64)
    check_blocks(block_m=bm, block_n=bn, block_k=bk)
    n_blocks = triton.cdiv(max(widths), bn)
    precision, upcast = dot_config(lora_b.dtype, out.dtype)
    grid = (triton.cdiv(longest, bm) * n_blocks, seg_slots.shape[0], num_slices)
    with on_device(out):
        _sgmv_expand_kernel[grid](
            y, lora_b, out, seg_starts, seg_slots, ranks if ranks is not None else seg_slots,
            *padded_widths(widths), r_max, n_blocks,
            y.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), out.stride(0),
            HAS_RANKS=ranks is not None, PRECISION=precision, UPCAST=upcast, Y_AS_B=out.dtype == lora_b.dtype,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
