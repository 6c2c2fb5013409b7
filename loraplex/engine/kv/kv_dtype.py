"""The KV cache's element types: float32, bfloat16 and float16 as they are; int8 and fp8 (e4m3) with scales.

- Layout: an 8-bit cache row (one token, one kv head) is head_dim 8-bit values and then their scale, the 4 bytes of
  an fp32, in the same tensor: the cache's last dimension is head_dim + 4 one-byte elements (row_width).
- value = q * scale, scale = absmax / 127 (int8, q rounded to nearest even in [-127, 127]) or absmax / 448 (fp8
  e4m3, q = x / scale rounded to nearest even e4m3); an all-zero row has scale 0.
- Why a scale per (token, kv head), stored in the row:
  - a token's K/V are written once and never change, so its scale is final when it is written; a per-block scale
    would grow as tokens arrive and force re-quantizing the block's earlier rows;
  - in the row, a block's scales move and are shared with it: the one index op that swaps a block out and in moves
    its scales, and prefix-cache hits share them, with nothing beside the cache to keep in step;
  - one token's outlier spoils only its own row, and 4 bytes per 64 values (head_dim 64) keep the cache at 68/256
    of fp32's bytes.
- int8 caches hold K centred and scaled per channel (kv/smoothing.py, unless kv_cache_smoothing is off): the rows
  are this module's all the same.
- Readers: the C kernels (kernels/cpu/decode_attention.c, kv_types.h) and the Triton kernels
  (kernels/paged_attention.py). The fused CPU decode step writes it with lp_kv_store, which rounds exactly as
  `quantize` does (its cache equals the per-op path's, byte for byte).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # an fp32 scale at the end of each 8-bit row
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest magnitude each 8-bit type holds
# Element-type codes in the C kernels' tables (kv_types.h, LP_KV_*): the floats share lora_weights.h's codes
KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether cache rows of `dtype` carry a scale (int8, fp8)."""
    return dtype in QMAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row (token, kv head): head_dim, plus the scale's 4 bytes for 8-bit types."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def unsupported(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a KV cache of `dtype` cannot hold heads of `head_dim`; None if it can."""
    if dtype not in KV_CODES:
        return f"KV cache dtype {dtype} (have: {', '.join(str(d) for d in KV_CODES)})"
    if is_quantized(dtype) and head_dim % SCALE_BYTES:
        return f"head_dim {head_dim} in an 8-bit KV cache (it needs a multiple of {SCALE_BYTES}: aligned scales)"
    return None


def raw(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor as uint8 (copies and index ops on fp8 are not implemented everywhere); others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows of `dtype` for x [..., head_dim] -> [..., row_width(head_dim, dtype)]."""
    if not is_quantized(dtype):
        return x.to(dtype)
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / QMAX[dtype]  # [..., 1]
    y = xf / torch.where(scale > 0, scale, 1.0)
    y = y.round().clamp_(-127, 127).to(torch.int8) if dtype == torch.int8 else y.clamp_(-448, 448).to(dtype)
    return torch.cat((raw(y), scale.view(torch.uint8)), -1).view(dtype)


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Values of cache rows [..., row_width] as `dtype` [..., head_dim] (8-bit: q * scale in fp32 first)."""
    if not is_quantized(rows.dtype):
        return rows.to(dtype)
    scale = raw(rows)[..., head_dim:].view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)


def write_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Stores x [tokens, kv_heads, head_dim] at flat `slots` of cache [blocks, block_size, kv_heads, width],
    rounded or quantized to the cache's dtype."""
    n_kv, width = cache.shape[2], cache.shape[3]
    raw(cache).view(-1, n_kv, width).index_copy_(0, slots, raw(quantize(x, cache.dtype)))
