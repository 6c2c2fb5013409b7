"""BGMV: batched gather matrix-vector LoRA kernels for decode-shaped batches (one slot index per token).

No segments: each program takes one token and gathers its adapter's weights, so a batch where every
request uses a different adapter costs what the weights cost to read once per token. Matrix-vector
products are done as broadcast multiply + row sums (tl.dot needs 16-row tiles, a decode token has one),
in fp32 whatever the dtypes (the weights may have another than the activations: EngineConfig.lora_dtype).
Layout of A and B: see lora_ops.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from loraplex.engine.kernels.launch import on_device
from loraplex.engine.kernels.lora_ops import check_a, check_expand, check_token_slots, check_x, check_y
from loraplex.engine.kernels.sgmv import check_blocks, check_triton_device, padded_widths, pow2_block, slice_bounds
from loraplex.engine.kernels.split_k import adapter_rank, k_range, store_split


@triton.jit
def _bgmv_shrink_kernel(x_ptr, a_ptr, y_ptr, slots_ptr, ranks_ptr, in_features, r_max, n_blocks,
                        stride_xm, stride_as, stride_ar, stride_ym,
                        HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)  # (slice, n block within the slice)
    pid_k = tl.program_id(2)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    s = pid_n // n_blocks
    n0 = (pid_n % n_blocks) * BLOCK_N
    rank = adapter_rank(ranks_ptr, slot, r_max, HAS_RANKS)
    if n0 >= rank:
        return  # all-padding rows: y was zero-filled
    offs_r = n0 + tl.arange(0, BLOCK_N)
    mask_r = offs_r < rank
    a_rows = s * r_max + offs_r
    k_start, k_end = k_range(pid_k, in_features, SPLIT_K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        xv = tl.load(x_ptr + t * stride_xm + offs_k, mask=mask_k, other=0.0)
        at = tl.load(a_ptr + slot * stride_as + a_rows[:, None] * stride_ar + offs_k[None, :],
                     mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        acc += at.to(tl.float32) * xv.to(tl.float32)[None, :]
    yv = tl.sum(acc, axis=1)
    store_split(y_ptr + t * stride_ym + a_rows, yv, mask_r, SPLIT_K)


@triton.jit
def _bgmv_expand_kernel(y_ptr, b_ptr, out_ptr, slots_ptr, ranks_ptr, w0, w1, w2, w3, r_max,
                        stride_ym, stride_bs, stride_bn, stride_bk, stride_om,
                        HAS_RANKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    s = tl.program_id(2)  # slice
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    off, width = slice_bounds(s, w0, w1, w2, w3)
    if n0 >= width:
        return
    rank = adapter_rank(ranks_ptr, slot, r_max, HAS_RANKS)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < width
    cols = off + offs_n
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < rank
        yv = tl.load(y_ptr + t * stride_ym + s * r_max + offs_k, mask=mask_k, other=0.0)
        bt = tl.load(b_ptr + slot * stride_bs + cols[:, None] * stride_bn + offs_k[None, :] * stride_bk,
                     mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += bt.to(tl.float32) * yv[None, :]
    o_ptrs = out_ptr + t * stride_om + cols
    o = tl.load(o_ptrs, mask=mask_n, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + tl.sum(acc, axis=1)).to(o.dtype), mask=mask_n)


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, *, num_slices: int = 1,
                ranks: torch.Tensor | None = None, y: torch.Tensor | None = None, split_k: int = 1,
                block_n: int | None = None, block_k: int | None = None,
                check_values: bool | None = None) -> torch.Tensor:
    """BGMV shrink: project every token onto its own adapter's low-rank space.

    Semantics:
        x [T, in] (fp32/bf16/fp16), lora_a [num_slots, S*r_max, in] (fp32/bf16/fp16), token_slots [T] int
        (-1 = no adapter), ranks [num_slots] int or None (None = every slot has rank r_max).
        For every token t with slot = token_slots[t] >= 0, slice s < S and k < r_max:
            y[t, s*r_max + k] = sum_i x[t, i] * A[slot, s*r_max + k, i]   if k < ranks[slot]
                              = 0                                          otherwise
        Rows of tokens with slot -1 are 0. Products and sums are fp32; y is fp32 [T, S*r_max]
        (returned; pass y= to reuse a buffer, which is zero-filled here).
    split_k > 1 splits the in_features reduction over programs that atomically add into y.
    """
    r_max = check_a(lora_a, num_slices, ranks)
    check_x(x, lora_a)
    check_triton_device(x)
    check_token_slots(token_slots, x.shape[0], lora_a.shape[0], x.device, check_values)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    if y is None:
        y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    else:
        check_y(y, x.shape[0], lora_a.shape[1], x.device)
        y.zero_()
    if x.shape[0] == 0:
        return y
    bn = block_n or pow2_block(r_max, 16, 64)
    bk = block_k or pow2_block(x.shape[1], 16, 256)
    check_blocks(block_n=bn, block_k=bk)
    n_blocks = triton.cdiv(r_max, bn)
    with on_device(x):
        _bgmv_shrink_kernel[(x.shape[0], num_slices * n_blocks, split_k)](
            x, lora_a, y, token_slots, ranks if ranks is not None else token_slots, x.shape[1], r_max, n_blocks,
            x.stride(0), lora_a.stride(0), lora_a.stride(1), y.stride(0),
            HAS_RANKS=ranks is not None, SPLIT_K=split_k, BLOCK_N=bn, BLOCK_K=bk)
    return y


def bgmv_expand(y: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, *,
                slice_widths: Sequence[int] | None = None, ranks: torch.Tensor | None = None,
                block_n: int | None = None, block_k: int | None = None,
                check_values: bool | None = None) -> None:
    """BGMV expand: add every token's LoRA delta to the base projection output, in place, all slices at once.

    Semantics:
        y [T, S*r_max] fp32, lora_b [num_slots, out_total, r_max] (contiguous or rank-major, any strides
        work), out [T, out_total] (fp32/bf16/fp16),
        token_slots [T] int, slice_widths (w_0..w_{S-1}) summing to out_total (None = S equal slices),
        off_s = w_0 + .. + w_{s-1}. For every token t with slot = token_slots[t] >= 0, slice s, n < w_s:
            out[t, off_s + n] += sum_{k < rank} y[t, s*r_max + k] * B[slot, off_s + n, k]
        with rank = min(ranks[slot], r_max) (r_max without ranks). Products and sums are fp32, the
        result is rounded once to out's dtype. Rows of tokens with slot -1 are not touched.
    """
    num_slices, r_max, widths = check_expand(y, lora_b, out, slice_widths, ranks)
    check_triton_device(out)
    check_token_slots(token_slots, out.shape[0], lora_b.shape[0], out.device, check_values)
    if out.shape[0] == 0:
        return
    bn = block_n or pow2_block(max(widths), 16, 128)
    bk = block_k or pow2_block(r_max, 16, 64)
    check_blocks(block_n=bn, block_k=bk)
    grid = (out.shape[0], triton.cdiv(max(widths), bn), num_slices)
    with on_device(out):
        _bgmv_expand_kernel[grid](
            y, lora_b, out, token_slots, ranks if ranks is not None else token_slots, *padded_widths(widths),
            r_max, y.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), out.stride(0),
            HAS_RANKS=ranks is not None, BLOCK_N=bn, BLOCK_K=bk)
