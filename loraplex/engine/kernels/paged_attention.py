"""Paged attention in Triton: decode rows and prefill chunks attend their context straight from the paged KV cache.

The runner writes this step's K/V into the cache first, so every key (earlier context and the new
chunk) is read through the block tables, key by key: slot = blocks[p // block_size] * block_size +
p % block_size. No gather, no padding, no mask tensor; any power-of-two block size works (1 included).
Both kernels run an online softmax (base 2, scale * log2(e) folded into the scores) with fp32
accumulation and write q's dtype. GQA without repeating K/V: one program holds several query heads of
one kv head as extra rows of its q tile, so each K/V tile it loads serves all of them.

- Decode: one program per (row, kv head, split) with the whole GQA group as the q tile [GROUP_PAD,
  BLOCK_D]; split-KV (flash-decoding) when few rows attend long contexts, merged by a reduce launch.
- Prefill: one launch for all chunks; one program per (tile of PREFILL_BLOCK_M queries, kv head,
  head chunk), key tiles past the tile's causal limit are never visited.

tl.dot inputs stay in the cache dtype on a GPU (tensor cores, fp32 accumulate; fp32 is "ieee", no
TF32). The interpreter's bf16 tl.dot is wrong (sgmv.dot_config), so there bf16 tiles are upcast first.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from loraplex.engine.kernels.launch import on_device
from loraplex.engine.kernels.lora_ops import FLOAT_DTYPES
from loraplex.engine.kernels.sgmv import check_triton_device, dot_config, pow2_block
from loraplex.engine.kv.kv_dtype import KV_CODES, raw, row_width

PREFILL_BLOCK_M = 32  # query rows (of one sequence) per prefill tile
DECODE_BLOCK_N = 64  # keys per decode inner step, 16-bit caches (raised to the block size, up to 128)
MAX_HEAD_DIM = 256
# Register budget of a prefill q tile (rows x BLOCK_D x element bytes): fits sm_90 without spills (ptxas -v
# over 16-bit and fp32 tiles, head dims 64..256); fp32 dots run as FMA loops, which need smaller tiles.
PREFILL_TILE_BYTES = {2: 32 * 1024, 4: 16 * 1024}
# Split-KV choice (paged_decode_attention with num_splits=None): split only when rows x kv heads leave
# SMs idle and contexts are long; each split gets at least SPLIT_MIN_KEYS keys.
MAX_SPLITS = 16
SPLIT_MIN_KEYS = 256
NOMINAL_SMS = 132  # SM count assumed off CUDA (the interpreter), an H100's
LOG2E = 1.4426950408889634


@triton.jit
def _fp8_as_f16(b):
    """fp8 e4m3 bytes (uint8) as fp32 values 2^-8 times theirs: the bits moved into an fp16 (exact)."""
    h = ((b.to(tl.uint16) & 0x80) << 8) | ((b.to(tl.uint16) & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _row_scales(s_ptr, kv_off, slot, stride_slot, mask_n, KV_QUANT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[BLOCK_N] fp32 scales of 8-bit rows (s_ptr: the cache as fp32 words; the scale follows HEAD_DIM bytes),
    times 256 for fp8 (undoing _fp8_as_f16's 2^-8)."""
    sc = tl.load(s_ptr + (kv_off + slot * stride_slot + HEAD_DIM) // 4, mask=mask_n, other=0.0)
    return sc * 256.0 if KV_QUANT == 2 else sc


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, k0, hi, q_pos, kv_off, stride_slot,
                 stride_bt, qk_scale, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 KV_QUANT: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """One online-softmax step over keys k0 .. k0+BLOCK_N-1 (those < hi), read through the block table.

    Semantics:
        q [M, BLOCK_D] (zero beyond HEAD_DIM), acc [M, BLOCK_D] fp32, m_i, l_i [M] fp32 (running max of the
        base-2 scores and running sum of 2^(s - m_i)); key n (position p = k0 + n < hi, and p <= q_pos[row]
        when CAUSAL) of kv head at kv_off sits at slot bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE.
        s = (q . k_p) * qk_scale;  m' = max(m_i, max_p s);  l' = l_i 2^(m_i - m') + sum_p 2^(s - m');
        acc' = acc 2^(m_i - m') + sum_p 2^(s - m') v_p.  Returns (acc', m', l').
        k_p, v_p are the cache's values in q's dtype: KV_QUANT 0 float rows as they are; 1 (int8) and 2 (fp8
        e4m3, uint8 bytes) 8-bit rows of HEAD_DIM values and an fp32 scale (kv/kv_dtype.py), whose scales are
        read through ks_ptr / vs_ptr (the caches as fp32 words) and applied to the scores and the weights.
    """
    offs_n = k0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    blk = tl.load(bt_ptr + (offs_n // BLOCK_SIZE) * stride_bt, mask=mask_n, other=0).to(tl.int64)
    slot = blk * BLOCK_SIZE + offs_n % BLOCK_SIZE  # [BLOCK_N] flat cache slots
    kt = tl.load(k_ptr + kv_off + slot[None, :] * stride_slot + offs_d[:, None],
                 mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N] = K^T tile
    v = tl.load(v_ptr + kv_off + slot[:, None] * stride_slot + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    if KV_QUANT == 1:
        kt, v = kt.to(tl.float32), v.to(tl.float32)
    elif KV_QUANT == 2:
        kt, v = _fp8_as_f16(kt), _fp8_as_f16(v)
    kt, v = kt.to(q.dtype), v.to(q.dtype)  # (q is fp32 when UPCAST; 8-bit values are exact in any float type)
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # [M, BLOCK_N]
    if KV_QUANT:
        s = s * _row_scales(ks_ptr, kv_off, slot, stride_slot, mask_n, KV_QUANT, HEAD_DIM)[None, :]
    allowed = mask_n[None, :]
    if CAUSAL:
        allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row has a key in its first tile
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [M, BLOCK_N]
    l_new = l_i * alpha + tl.sum(p, 1)
    if KV_QUANT:
        p = p * _row_scales(vs_ptr, kv_off, slot, stride_slot, mask_n, KV_QUANT, HEAD_DIM)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_new


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                         rows_ptr, lens_ptr, row_table_ptr, bt_ptr, qk_scale, num_heads,
                         stride_qm, stride_qh, stride_om, stride_oh, stride_slot, stride_kh, stride_bt0, stride_bt1,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_QUANT: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
    """Decode rows: all GROUP query heads of one kv head of one row, over one split of its context.

    Semantics:
        Program (r, g, s); row = rows[r], L = lens[r], table = bt[row_table[r]]; heads h = g*GROUP + i, i < GROUP.
        NUM_SPLITS == 1: keys 0..L-1, out[row, h] = sum_p softmax_p(scale * q[row, h] . K[p, g]) V[p, g].
        NUM_SPLITS > 1: keys [s*C, min((s+1)*C, L)) with C = ceil(ceil(L / NUM_SPLITS) / BLOCK_N) * BLOCK_N;
        part_m/part_l [R, heads, NUM_SPLITS] get the split's base-2 max / sum (-inf / 0 when empty) and
        part_acc [R, heads, NUM_SPLITS, HEAD_DIM] its unnormalized fp32 sum; _split_reduce_kernel merges.
    """
    r = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + r).to(tl.int64)
    ctx = tl.load(lens_ptr + r)
    table = tl.load(row_table_ptr + r).to(tl.int64)
    offs_i = tl.arange(0, GROUP_PAD)
    mask_i = offs_i < GROUP
    heads = g * GROUP + offs_i  # [GROUP_PAD]
    offs_d = tl.arange(0, BLOCK_D)
    mask_q = mask_i[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * stride_qm + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_q,
                other=0.0)  # [GROUP_PAD, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    lo = 0
    hi = ctx
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, ctx)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    bt_row = bt_ptr + table * stride_bt0
    kv_off = g.to(tl.int64) * stride_kh
    for k0 in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, k0, hi, offs_i, kv_off,
                                     stride_slot, stride_bt1, qk_scale, CAUSAL=False, PRECISION=PRECISION,
                                     UPCAST=UPCAST, KV_QUANT=KV_QUANT, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
                                     BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM)
    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + row * stride_om + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_q)
    else:
        part = (r.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_m_ptr + part, m_i, mask=mask_i)
        tl.store(part_l_ptr + part, l_i, mask=mask_i)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_q)


@triton.jit
def _split_reduce_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, rows_ptr, num_heads, stride_om, stride_oh,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
    """Merges the splits of one decode row and head (flash-decoding's second pass).

    Semantics:
        Program (r, h): with M = max_s part_m[r, h, s] and w_s = 2^(part_m[r, h, s] - M) (0 for empty splits),
        out[rows[r], h] = sum_s w_s part_acc[r, h, s] / sum_s w_s part_l[r, h, s], rounded to out's dtype.
    """
    r = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    part = (r.to(tl.int64) * num_heads + h) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + part, mask=mask_s, other=float("-inf"))
    lsum = tl.load(part_l_ptr + part, mask=mask_s, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [SPLITS_PAD, BLOCK_D]
    w = tl.exp2(m - tl.max(m, 0))  # split 0 always has keys (lens >= 1), so the max is finite
    o = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(out_ptr + row * stride_om + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tile_seq_ptr, tile_start_ptr, seq_rows_ptr,
                          seq_new_ptr, seq_computed_ptr, seq_table_ptr, bt_ptr, qk_scale,
                          stride_qm, stride_qh, stride_om, stride_oh, stride_slot, stride_kh, stride_bt0, stride_bt1,
                          GROUP: tl.constexpr, HEADS_PER_PROG: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                          PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_QUANT: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          HEAD_DIM: tl.constexpr):
    """Prefill chunks: BLOCK_M queries of one chunk x HEADS_PER_PROG heads of one kv head, causal.

    Semantics:
        Program (t, g * NUM_CHUNKS + c); i = tile_seq[t], j0 = tile_start[t], C = seq_computed[i], n = seq_new[i],
        table = bt[seq_table[i]]. q tile row m = a * BLOCK_M + b is query j = j0 + b (if j < n) of head
        h = g*GROUP + c*HEADS_PER_PROG + a (if c*HEADS_PER_PROG + a < GROUP), at position C + j:
            out[seq_rows[i] + j, h] = sum_{p <= C + j} softmax_p(scale * q[seq_rows[i] + j, h] . K[p, g]) V[p, g]
        Only key tiles below C + min(j0 + BLOCK_M, n) (the tile's last query, inclusive) are visited.
    """
    t = tl.program_id(0)
    g = tl.program_id(1) // NUM_CHUNKS
    c = tl.program_id(1) % NUM_CHUNKS
    seq = tl.load(tile_seq_ptr + t)
    j0 = tl.load(tile_start_ptr + t)
    row0 = tl.load(seq_rows_ptr + seq).to(tl.int64)
    n_new = tl.load(seq_new_ptr + seq)
    computed = tl.load(seq_computed_ptr + seq)
    table = tl.load(seq_table_ptr + seq).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M * HEADS_PER_PROG)
    j = j0 + offs_m % BLOCK_M  # [rows] query index in the chunk
    in_group = c * HEADS_PER_PROG + offs_m // BLOCK_M
    heads = g * GROUP + in_group
    offs_d = tl.arange(0, BLOCK_D)
    mask_q = ((j < n_new) & (in_group < GROUP))[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (row0 + j)[:, None] * stride_qm + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_q,
                other=0.0)  # [rows, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = computed + j
    hi = computed + tl.minimum(j0 + BLOCK_M, n_new)  # keys past the tile's last query are never needed
    acc = tl.zeros((BLOCK_M * HEADS_PER_PROG, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M * HEADS_PER_PROG,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M * HEADS_PER_PROG,), dtype=tl.float32)
    bt_row = bt_ptr + table * stride_bt0
    kv_off = g.to(tl.int64) * stride_kh
    for k0 in range(0, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, k0, hi, q_pos, kv_off,
                                     stride_slot, stride_bt1, qk_scale, CAUSAL=True, PRECISION=PRECISION,
                                     UPCAST=UPCAST, KV_QUANT=KV_QUANT, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
                                     BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM)
    o = acc / l_i[:, None]
    tl.store(out_ptr + (row0 + j)[:, None] * stride_om + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_q)


# ---------------------------------------------------------------------------------------------- launchers

def _check_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     block_tables: torch.Tensor) -> tuple[int, int]:
    """Refuses tensors the kernels cannot read (ValueError); returns (group, block_size)."""
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be fp32/bf16/fp16, got {q.dtype}")
    if out.dtype != q.dtype:
        raise ValueError(f"out dtype {out.dtype} != q dtype {q.dtype}")
    if k_cache.dtype not in KV_CODES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must be one KV cache dtype ({', '.join(map(str, KV_CODES))}), got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    for name, t in (("out", out), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must be [tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(out.shape)}")
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out need a contiguous last (head_dim) dimension")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be one [num_blocks, block_size, kv_heads, row width] shape, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    _, block_size, kv_heads, width = k_cache.shape
    heads, head_dim = q.shape[1], q.shape[2]
    if width != row_width(head_dim, k_cache.dtype) or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} of q vs rows of {width} in the {k_cache.dtype} cache (at most "
                         f"{MAX_HEAD_DIM})")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be a 2-D int32 tensor, got {block_tables.dtype} {block_tables.dim()}-D")
    check_triton_device(q)
    return heads // kv_heads, block_size


def _check_index(device: torch.device, **tensors: torch.Tensor) -> int:
    """Index tensors: 1-D int32 on `device`, one length (returned)."""
    lengths = set()
    for name, t in tensors.items():
        if t.dtype != torch.int32 or t.dim() != 1 or t.device != device:
            raise ValueError(f"{name} must be a 1-D int32 tensor on {device}, got {t.dtype} {t.dim()}-D on {t.device}")
        lengths.add(t.shape[0])
    if len(lengths) > 1:
        raise ValueError(f"{', '.join(tensors)} must have one length, got {sorted(lengths)}")
    return lengths.pop()


def _check_scratch(scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_splits: int | None,
                   shape: tuple[int, int, int], head_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Caller-given split scratch: needs a forced num_splits and exact fp32 shapes on q's device."""
    if num_splits is None:
        raise ValueError("split scratch needs an explicit num_splits")
    want = (shape, shape, (*shape, head_dim))
    for name, t, w in zip(("part_m", "part_l", "part_acc"), scratch, want, strict=True):
        if t.dtype != torch.float32 or tuple(t.shape) != w or t.device != device or not t.is_contiguous():
            raise ValueError(f"scratch {name} must be contiguous fp32 {w} on {device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    return scratch


def _dot_args(q: torch.Tensor) -> dict:
    precision, upcast = dot_config(q.dtype)
    return {"PRECISION": precision, "UPCAST": upcast, "BLOCK_D": pow2_block(q.shape[2], 16, MAX_HEAD_DIM),
            "HEAD_DIM": q.shape[2]}


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], int]:
    """(k, v, their scale words, KV_QUANT) as the kernels take a cache: 8-bit ones as bytes (fp8 as uint8) and
    again as fp32 words, where each row's scale is read (unused for float caches)."""
    quant = {torch.int8: 1, torch.float8_e4m3fn: 2}.get(k_cache.dtype, 0)
    if not quant:
        return (k_cache, v_cache, k_cache, v_cache), 0
    k, v = (raw(c) if quant == 2 else c for c in (k_cache, v_cache))
    return (k, v, raw(k_cache).view(torch.float32), raw(v_cache).view(torch.float32)), quant


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return NOMINAL_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_config(block_size: int, block_d: int, elem_bytes: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of a decode launch, spill-free on sm_90 (ptxas -v): fp32 dots run as FMA loops
    and need smaller key tiles than 16-bit ones on tensor cores."""
    if elem_bytes >= 4:
        return (32 if block_d <= 128 else 16), (4 if block_d <= 32 else 8)
    block_n = min(max(DECODE_BLOCK_N, block_size), 128)
    return block_n, 8 if block_n * block_d * elem_bytes >= 32 * 1024 else 4


def choose_num_splits(num_rows: int, kv_heads: int, max_len: int, num_sms: int) -> int:
    """Split-KV count for a decode call: 1 unless rows x kv heads leave SMs idle and contexts are long.

    Splits fill about two waves of programs, each split keeping >= SPLIT_MIN_KEYS keys, at most MAX_SPLITS.
    """
    programs = max(num_rows * kv_heads, 1)
    by_len = max_len // SPLIT_MIN_KEYS
    by_sms = triton.cdiv(2 * num_sms, programs)
    return max(1, min(MAX_SPLITS, by_len, by_sms)) if programs < num_sms else 1


def prefill_tiles(seq_new: list[int]) -> tuple[list[int], list[int]]:
    """(tile_seq, tile_start): for each BLOCK_M-row tile of each prefill chunk, its sequence index and first query
    index within the chunk."""
    tile_seq: list[int] = []
    tile_start: list[int] = []
    for i, n in enumerate(seq_new):
        starts = range(0, n, PREFILL_BLOCK_M)
        tile_seq.extend([i] * len(starts))
        tile_start.extend(starts)
    return tile_seq, tile_start


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           rows: torch.Tensor, lens: torch.Tensor, row_table: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, max_len: int,
                           num_splits: int | None = None,
                           scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Decode (and draft) rows: each row is one query token attending its first lens[r] context keys, in place.

    Semantics:
        q, out [tokens, heads, head_dim] (fp32/bf16/fp16, any row/head strides, contiguous head_dim);
        k_cache, v_cache [num_blocks, block_size, kv_heads, row width] contiguous, of one KV cache dtype
        (kv/kv_dtype.py: fp32/bf16/fp16 rows, or int8/fp8 rows with their scales; read as fp32 values);
        rows, lens, row_table [R] int32; block_tables [S, max_blocks] int32. With row = rows[r],
        blocks = block_tables[row_table[r]], group = heads // kv_heads, K[p] = k_cache[blocks[p // block_size],
        p % block_size] (V alike), for every r and head h:
            out[row, h] = sum_{p < lens[r]} softmax_p(scale * q[row, h] . K[p, h // group]) V[p, h // group]
        in fp32, rounded once to out's dtype. lens[r] >= 1. Other rows of out are not touched.
    max_len (host-known max(lens)) only picks the split count: num_splits None = choose_num_splits (split-KV
    when few rows attend long contexts), an int forces it. num_splits > 1 adds a reduce launch and fp32
    scratch of R x heads x num_splits x (head_dim + 2), allocated per call unless `scratch` gives it: (part_m,
    part_l [R, heads, num_splits], part_acc [R, heads, num_splits, head_dim]) fp32 on q's device, which a CUDA
    graph needs fixed (engine/static_decode.py); it takes an explicit num_splits.
    """
    group, block_size = _check_attention(q, k_cache, v_cache, out, block_tables)
    n_rows = _check_index(q.device, rows=rows, lens=lens, row_table=row_table)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if n_rows == 0:
        return
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    splits = num_splits or choose_num_splits(n_rows, kv_heads, max_len, _sm_count(q.device))
    part_m = part_l = part_acc = out  # unused (pointer placeholders) without splits
    if splits > 1 and scratch is not None:
        part_m, part_l, part_acc = _check_scratch(scratch, num_splits, (n_rows, heads, splits), head_dim, q.device)
    elif splits > 1:
        part_m = torch.empty(n_rows, heads, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(n_rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    dot = _dot_args(q)
    block_n, num_warps = _decode_config(block_size, dot["BLOCK_D"], q.element_size())
    caches, quant = _cache_args(k_cache, v_cache)
    with on_device(q):
        _paged_decode_kernel[(n_rows, kv_heads, splits)](
            q, *caches, out, part_m, part_l, part_acc, rows, lens, row_table, block_tables,
            scale * LOG2E, heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), block_tables.stride(1),
            GROUP=group, GROUP_PAD=pow2_block(group, 16, 1 << 30), NUM_SPLITS=splits, KV_QUANT=quant,
            BLOCK_SIZE=block_size, BLOCK_N=block_n, num_warps=num_warps, **dot)
        if splits > 1:
            _split_reduce_kernel[(n_rows, heads)](
                out, part_m, part_l, part_acc, rows, heads, out.stride(0), out.stride(1),
                NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), BLOCK_D=dot["BLOCK_D"],
                HEAD_DIM=head_dim, num_warps=1 if head_dim <= 64 else 2)


def _prefill_config(group: int, block_d: int, elem_bytes: int) -> tuple[int, int, int]:
    """(heads per program, BLOCK_N, num_warps) of a prefill launch: as many heads of one GQA group stacked in the
    q tile (PREFILL_BLOCK_M rows each) as PREFILL_TILE_BYTES allows, so one K/V tile read serves them all."""
    budget = PREFILL_TILE_BYTES[min(elem_bytes, 4)]
    per_prog = 1
    while per_prog < group and PREFILL_BLOCK_M * per_prog * 2 * block_d * elem_bytes <= budget:
        per_prog *= 2
    tile = PREFILL_BLOCK_M * per_prog * block_d * elem_bytes
    return per_prog, 16 if tile > budget else 32, 8 if tile >= 16 * 1024 else 4


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                            tile_seq: torch.Tensor, tile_start: torch.Tensor, seq_rows: torch.Tensor,
                            seq_new: torch.Tensor, seq_computed: torch.Tensor, seq_table: torch.Tensor,
                            block_tables: torch.Tensor, scale: float) -> None:
    """Prefill chunks (query length >= 1 each), causal over their whole context, all in ONE launch, in place.

    Semantics:
        q, out, k_cache, v_cache, block_tables, K, V and group as in paged_decode_attention; seq_rows, seq_new,
        seq_computed, seq_table [P] int32; tile_seq, tile_start [n_tiles] int32 from prefill_tiles(seq_new).
        For every sequence i, query j < seq_new[i] (row = seq_rows[i] + j, position c + j with
        c = seq_computed[i]; blocks = block_tables[seq_table[i]]) and head h:
            out[row, h] = sum_{p <= c + j} softmax_p(scale * q[row, h] . K[p, h // group]) V[p, h // group]
        in fp32, rounded once to out's dtype. Other rows of out are not touched.
    Grid (n_tiles, kv_heads * head chunks): each program stacks several heads of one GQA group in its q tile
    (_prefill_config), so one K/V tile read serves them all.
    """
    group, block_size = _check_attention(q, k_cache, v_cache, out, block_tables)
    n_tiles = _check_index(q.device, tile_seq=tile_seq, tile_start=tile_start)
    _check_index(q.device, seq_rows=seq_rows, seq_new=seq_new, seq_computed=seq_computed, seq_table=seq_table)
    if n_tiles == 0:
        return
    dot = _dot_args(q)
    per_prog, block_n, num_warps = _prefill_config(group, dot["BLOCK_D"], q.element_size())
    n_chunks = math.ceil(group / per_prog)
    caches, quant = _cache_args(k_cache, v_cache)
    with on_device(q):
        _paged_prefill_kernel[(n_tiles, k_cache.shape[2] * n_chunks)](
            q, *caches, out, tile_seq, tile_start, seq_rows, seq_new, seq_computed, seq_table,
            block_tables, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), block_tables.stride(1),
            GROUP=group, HEADS_PER_PROG=per_prog, NUM_CHUNKS=n_chunks, KV_QUANT=quant, BLOCK_SIZE=block_size,
            BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=block_n, num_warps=num_warps, **dot)
