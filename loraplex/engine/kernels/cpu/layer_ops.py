"""Fused per-layer CPU ops through layer_ops.c and decode_attention.c (see their Semantics). fp32, contiguous
CPU tensors (the KV cache in any kv/kv_dtype.py type).

These sit on a decode step's hot path, so the checks here are the cheap ones that keep a wrong
call from reading out of bounds: dtype, device, layout and matching sizes.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from loraplex.engine.kernels.cpu.build import functions, require
from loraplex.engine.kv.kv_dtype import KV_CODES, row_width

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.cache
def _fns() -> dict | None:
    return functions({
        "lp_add_rms_norm_f32": (None, [_P, _P, _P, _I64, _I64, _F, _P]),
        "lp_rope_f32": (None, [_P, _I64, _I64, _I64, _I64, _P, _P, _P]),
        "lp_silu_mul_f32": (None, [_P, _I64, _I64, _P]),
        "lp_kv_store": (None, [_P, _P, _I64, _I64, _I64]),
        "lp_decode_attention_f32": (ctypes.c_int, [_P, _I64, _P, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64,
                                                   _I64, _F, _P]),
    })


def layer_ops_available() -> bool:
    return _fns() is not None


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta in place (the residual stream), then returns rms_norm(h) * w. h, delta: [T, H]."""
    fns = _fns()
    require("h", h, 2)
    require("w", w, 1)
    if delta is not None:
        require("delta", delta, 2)
        if delta.shape != h.shape:
            raise ValueError(f"delta has shape {tuple(delta.shape)}, h has {tuple(h.shape)}")
    if w.shape[0] != h.shape[1]:
        raise ValueError(f"norm weight has {w.shape[0]} entries for hidden size {h.shape[1]}")
    out = torch.empty_like(h)
    fns["lp_add_rms_norm_f32"](h.data_ptr(), None if delta is None else delta.data_ptr(), w.data_ptr(),
                               h.shape[0], h.shape[1], eps, out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate | up) -> [T, I]."""
    fns = _fns()
    require("gate_up", gate_up, 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even width (gate | up), got {gate_up.shape[1]}")
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=torch.float32)
    fns["lp_silu_mul_f32"](gate_up.data_ptr(), t, inter, out.data_ptr())
    return out


def rope_(x: torch.Tensor, n_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotates the first n_heads heads of each row of x [T, >= n_heads * head_dim] in place.
    positions: [T] int64, each in [0, max_pos): the caller checks them once per step, not per layer;
    cos, sin: [max_pos, head_dim]."""
    fns = _fns()
    require("x", x, 2, rows=True)
    require("positions", positions, 1, torch.int64)
    require("cos", cos, 2)
    require("sin", sin, 2)
    if x.shape[1] < n_heads * head_dim or cos.shape[1] != head_dim or sin.shape != cos.shape:
        raise ValueError(f"rope: x {tuple(x.shape)}, {n_heads} heads of {head_dim}, tables {tuple(cos.shape)}")
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"rope: {positions.shape[0]} positions for {x.shape[0]} rows")
    fns["lp_rope_f32"](x.data_ptr(), x.shape[0], x.stride(0), n_heads, head_dim, positions.data_ptr(),
                       cos.data_ptr(), sin.data_ptr())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context (no K/V gather).

    q: [B, H, D] (rows may be strided, heads dense); k_cache, v_cache: [blocks, block_size, KVH, row width]
    of one kv/kv_dtype.py type (8-bit rows are dequantized as they are read);
    tables: [B, max_blocks] int64 block ids; lens: [B] int64 context lengths, each <= max_len
    (the caller's host-side maximum, so no device read is needed). Returns [B, H, D].
    """
    fns = _fns()
    if q.dim() != 3 or q.stride(2) != 1 or q.stride(1) != q.shape[2] or q.dtype != torch.float32:
        raise ValueError(f"q must be [B, H, D] fp32 with dense heads, got {tuple(q.shape)} strides {q.stride()}")
    if k_cache.dtype not in KV_CODES:
        raise ValueError(f"decode attention: a KV cache of {k_cache.dtype} (have: {', '.join(map(str, KV_CODES))})")
    require("k_cache", k_cache, 4, k_cache.dtype)
    require("v_cache", v_cache, 4, k_cache.dtype)
    require("tables", tables, 2, torch.int64)
    require("lens", lens, 1, torch.int64)
    b, h, d = q.shape
    n_blocks, bs, kvh, width = k_cache.shape
    if v_cache.shape != k_cache.shape or width != row_width(d, k_cache.dtype) or h % kvh or tables.shape[0] != b \
            or lens.shape[0] != b:
        raise ValueError(f"decode attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, "
                         f"tables {tuple(tables.shape)}, lens {tuple(lens.shape)} do not match")
    if max_len > tables.shape[1] * bs:
        raise ValueError(f"decode attention: context {max_len} exceeds {tables.shape[1]} blocks of {bs}")
    out = torch.empty(b, h, d, dtype=torch.float32)
    rc = fns["lp_decode_attention_f32"](q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                        KV_CODES[k_cache.dtype], tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                                        b, h, kvh, d, bs, scale, out.data_ptr())
    if rc:  # (-1, an unknown type, is checked above; a future failure code must not pass silently)
        raise RuntimeError(f"decode attention failed with code {rc}")
    return out


def kv_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows of x [kv_heads, head_dim] fp32 in `dtype`, as the fused decode step writes them (lp_kv_store):
    [kv_heads, row width], the same bytes as kv/kv_dtype.py's quantize."""
    fns = _fns()
    require("x", x, 2)
    if dtype not in KV_CODES:
        raise ValueError(f"kv rows: a KV cache of {dtype} (have: {', '.join(map(str, KV_CODES))})")
    out = torch.empty(x.shape[0], row_width(x.shape[1], dtype), dtype=dtype)
    fns["lp_kv_store"](out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], KV_CODES[dtype])
    return out
