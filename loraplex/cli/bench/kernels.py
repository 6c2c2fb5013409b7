"""`loraplex bench kernels`: the Triton kernels against the torch path they replace, on the same inputs.

- Multi-LoRA on Llama-3-8B's fused qkv (hidden 4096, slices 4096/1024/1024, rank 16, 8 adapters): BGMV on
  64 decode rows of mixed adapters and SGMV on a 512-token prefill (one segment per adapter), each against
  lora_shrink_expand_torch (the torch path, kernel "auto") and checked against reference.py.
- Paged attention with Llama-3-8B's heads (32 query, 8 kv, head_dim 128), block size 16: decode of 64 rows
  at contexts 1024 and 4096 against attention/torch_sdpa.py's decode (K/V gathered a block at a time into a
  padded [rows, kv_heads, L, head_dim], one SDPA with an additive mask), and a prefill of 4 chunks of 512
  tokens after 512 cached ones against a gather + masked SDPA per chunk; both checked against
  paged_attention_ref. Decode's achieved GB/s (K/V bytes over time) is set against the device's read
  bandwidth, measured in the same run (roofline.measure).

Each time is per call: the best of `repeats` timings of `iters` calls, the device synchronised around each
(roofline.best_seconds). On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1): only
--quick's tiny shapes, a smoke run whose times say nothing about a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loraplex.cli.bench import roofline
from loraplex.engine.kernels.lora_ops import (
    LoraBatchIndex,
    lora_shrink_expand,
    lora_shrink_expand_torch,
    stacked_b,
)
from loraplex.engine.kernels.paged_attention import paged_decode_attention, paged_prefill_attention, prefill_tiles
from loraplex.engine.kernels.paged_attention_ref import context_slots, paged_attention_ref
from loraplex.engine.kernels.reference import ref_lora_shrink_expand

CPU_NOTE = ("cpu: the Triton kernels ran in the interpreter (TRITON_INTERPRET=1) on tiny shapes; these times say "
            "nothing about a GPU, only a CUDA run's are meaningful")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """One run's problem sizes (LoRA, then attention) and how often each call is timed."""

    hidden: int
    kv_width: int  # k and v slices of the fused qkv output
    rank: int
    adapters: int
    decode_tokens: int
    prefill_tokens: int  # split into one segment per adapter
    heads: int
    kv_heads: int
    head_dim: int
    batch: int  # decode rows
    contexts: tuple[int, ...]
    block_size: int
    prefill_seqs: int
    prefill_new: int
    prefill_computed: int
    repeats: int
    iters: int


FULL = Shapes(hidden=4096, kv_width=1024, rank=16, adapters=8, decode_tokens=64, prefill_tokens=512,
              heads=32, kv_heads=8, head_dim=128, batch=64, contexts=(1024, 4096), block_size=16,
              prefill_seqs=4, prefill_new=512, prefill_computed=512, repeats=5, iters=20)
QUICK = Shapes(hidden=64, kv_width=32, rank=16, adapters=4, decode_tokens=4, prefill_tokens=32,
               heads=4, kv_heads=2, head_dim=32, batch=3, contexts=(40,), block_size=16,
               prefill_seqs=2, prefill_new=20, prefill_computed=12, repeats=1, iters=1)


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference, in fp32 on the host."""
    return float((got.detach().float().cpu() - want.detach().float().cpu()).abs().max())


def compare(triton_fn: Callable[[], object], torch_fn: Callable[[], object], shapes: Shapes,
            device: torch.device) -> dict:
    """Seconds per call of each path (synchronised), and how many times faster Triton is."""
    tri = roofline.best_seconds(triton_fn, shapes.repeats, device, shapes.iters)
    tor = roofline.best_seconds(torch_fn, shapes.repeats, device, shapes.iters)
    # the speedup to 3 significant digits: the interpreter can run 1000s of times slower (3 decimals would say 0)
    return {"triton_us": round(tri * 1e6, 2), "torch_us": round(tor * 1e6, 2),
            "triton_speedup": float(f"{tor / tri:.3g}")}


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal values on the generator's device (drawn in fp32, so every dtype sees the same numbers)."""
    return torch.randn(*shape, generator=gen, device=gen.device, dtype=torch.float32).mul_(scale).to(dtype)


# ------------------------------------------------------------------------------------------- LoRA

def lora_case(shapes: Shapes, device: torch.device, dtype: torch.dtype, index: LoraBatchIndex, kernel: str) -> dict:
    """One fused-qkv LoRA call (out += B @ (A @ x) per token's adapter): Triton `kernel` vs the torch path."""
    s, gen = shapes, torch.Generator(device).manual_seed(1)
    widths = (s.hidden, s.kv_width, s.kv_width)
    x = _randn(gen, index.num_tokens, s.hidden, dtype=dtype)  # [T, hidden]
    out0 = _randn(gen, index.num_tokens, sum(widths), dtype=dtype)  # [T, out_total]: the base projection's
    lora_a = _randn(gen, s.adapters, 3 * s.rank, s.hidden, dtype=dtype, scale=s.hidden ** -0.5)
    lora_b = stacked_b(s.adapters, sum(widths), s.rank, dtype, device)  # rank-major, as the slot buffers
    lora_b.copy_(_randn(gen, s.adapters, sum(widths), s.rank, dtype=dtype, scale=0.1))

    def triton_path(out: torch.Tensor) -> None:
        lora_shrink_expand(x, out, lora_a, lora_b, index, slice_widths=widths, kernel=kernel)

    def torch_path(out: torch.Tensor) -> None:
        lora_shrink_expand_torch(x, out, lora_a, lora_b, index, slice_widths=widths)

    want = ref_lora_shrink_expand(x.cpu(), out0.cpu(), lora_a.cpu(), lora_b.cpu(), index.token_slots.cpu(), widths)
    errors = {}
    for name, path in (("triton", triton_path), ("torch", torch_path)):
        out = out0.clone()
        path(out)
        errors[f"max_abs_err_{name}"] = max_err(out, want)
    scratch = out0.clone()  # timed calls keep adding into it
    return {"tokens": index.num_tokens, "segments": len(index.lora_segments), **errors,
            **compare(lambda: triton_path(scratch), lambda: torch_path(scratch), s, device)}


def lora_cases(shapes: Shapes, device: torch.device, dtype: torch.dtype) -> dict:
    """BGMV on decode rows (each its own draw of adapter), SGMV on a prefill (one segment per adapter)."""
    slots = torch.randint(0, shapes.adapters, (shapes.decode_tokens,), generator=torch.Generator().manual_seed(2))
    decode = LoraBatchIndex.from_token_slots(slots.tolist(), device)
    per = shapes.prefill_tokens // shapes.adapters
    prefill = LoraBatchIndex.from_segments([per] * shapes.adapters, list(range(shapes.adapters)), device)
    return {"bgmv_decode": lora_case(shapes, device, dtype, decode, "bgmv"),
            "sgmv_prefill": lora_case(shapes, device, dtype, prefill, "sgmv")}


# ------------------------------------------------------------------------------------- attention

def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA with fewer kv heads than query heads (enable_gqa, torch >= 2.5; K/V repeated before that)."""
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    except TypeError:
        group = q.shape[-3] // k.shape[-3]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, -3), v.repeat_interleave(group, -3),
                                              attn_mask=mask)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere, in the model dtype (as attention/torch_sdpa.py builds it once per step)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """attention/torch_sdpa.py's decode: whole blocks gathered by block table (index_select), one padded SDPA.
    q [rows, heads, D]; blocks [rows, max_blocks] int64; mask [rows, 1, 1, max_blocks * block_size]."""
    n, kv, d = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    k = torch.index_select(k_cache, 0, blocks.view(-1)).view(n, -1, kv, d).transpose(1, 2)  # [rows, kv, L, D]
    v = torch.index_select(v_cache, 0, blocks.view(-1)).view(n, -1, kv, d).transpose(1, 2)
    return sdpa_gqa(q.unsqueeze(2), k, v, mask).squeeze(2)  # [rows, heads, D]


def sdpa_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
    """attention/torch_sdpa.py's prefill after cached context: per chunk (start, end, slots, mask), its context's K/V
    gathered slot by slot and one SDPA with the causal mask aligned to the end."""
    kv, d = k_cache.shape[2], k_cache.shape[3]
    k_flat, v_flat = k_cache.view(-1, kv, d), v_cache.view(-1, kv, d)  # [slots, kv, D]
    for start, end, slots, mask in chunks:  # 4-D, as the engine calls it (CUDA's fused SDPA kernels want 4-D)
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, D]
        ks = torch.index_select(k_flat, 0, slots).transpose(0, 1).unsqueeze(0)  # [1, kv, context, D]
        vs = torch.index_select(v_flat, 0, slots).transpose(0, 1).unsqueeze(0)
        out[start:end] = sdpa_gqa(qs, ks, vs, mask)[0].transpose(0, 1)


def _paged_cache(shapes: Shapes, seqs: int, context: int, device: torch.device, dtype: torch.dtype):
    """K and V caches holding `seqs` contexts whose blocks are scattered over the cache (as after churn), and
    the block table [seqs, blocks per context] (int64, on the host)."""
    s, gen = shapes, torch.Generator(device).manual_seed(context)
    per_seq = math.ceil(context / s.block_size)
    k_cache = _randn(gen, seqs * per_seq, s.block_size, s.kv_heads, s.head_dim, dtype=dtype)
    v_cache = _randn(gen, seqs * per_seq, s.block_size, s.kv_heads, s.head_dim, dtype=dtype)
    table = torch.randperm(seqs * per_seq, generator=torch.Generator().manual_seed(context)).view(seqs, per_seq)
    return k_cache, v_cache, table, gen


def _i32(values, device: torch.device) -> torch.Tensor:
    """The kernels' index tensors: int32 on the device."""
    return torch.as_tensor(values, dtype=torch.int32).to(device)


def decode_case(shapes: Shapes, context: int, device: torch.device, dtype: torch.dtype, read_gbs: float) -> dict:
    """Decode rows of one context length each: paged_decode_attention vs the gather + SDPA path."""
    s = shapes
    k_cache, v_cache, table, gen = _paged_cache(s, s.batch, context, device, dtype)
    q = _randn(gen, s.batch, s.heads, s.head_dim, dtype=dtype)  # [rows, heads, D]
    scale = s.head_dim ** -0.5
    rows = _i32(range(s.batch), device)  # row r uses block-table row r too
    lens = _i32([context] * s.batch, device)
    tables = table.to(device)  # [rows, blocks] int64 for index_select
    mask = additive_mask(torch.arange(tables.shape[1] * s.block_size, device=device) < context, dtype)
    mask = mask.expand(s.batch, 1, 1, -1).contiguous()  # [rows, 1, 1, L], as AttentionMetadata.decode_mask
    out = torch.empty_like(q)
    bt32 = tables.int()
    def triton_path() -> None:
        paged_decode_attention(q, k_cache, v_cache, out, rows, lens, rows, bt32, scale, context)

    def torch_path() -> torch.Tensor:
        return sdpa_decode(q, k_cache, v_cache, tables, mask)

    want = paged_attention_ref(q, k_cache, v_cache, [(i, 1, context - 1, table[i].tolist()) for i in range(s.batch)],
                               scale)
    triton_path()
    result = {"rows": s.batch, "context": context, "max_abs_err_triton": max_err(out, want),
              "max_abs_err_torch": max_err(torch_path(), want), **compare(triton_path, torch_path, s, device)}
    kv_bytes = 2 * s.batch * context * s.kv_heads * s.head_dim * k_cache.element_size()
    for side in ("triton", "torch"):
        result[f"{side}_gbs"] = round(kv_bytes / (result[f"{side}_us"] * 1e-6) / 1e9, 1)
    result.update(kv_bytes=kv_bytes, fraction_of_read_bandwidth=round(result["triton_gbs"] / read_gbs, 3))
    return result


def prefill_case(shapes: Shapes, device: torch.device, dtype: torch.dtype) -> dict:
    """Prefill chunks after cached context (their own K/V already in the cache, as the runner writes them):
    paged_prefill_attention in one launch vs a gather + masked SDPA per chunk."""
    s = shapes
    n, c, total = s.prefill_new, s.prefill_computed, s.prefill_new + s.prefill_computed
    k_cache, v_cache, table, gen = _paged_cache(s, s.prefill_seqs, total, device, dtype)
    q = _randn(gen, s.prefill_seqs * n, s.heads, s.head_dim, dtype=dtype)  # [tokens, heads, D]
    scale = s.head_dim ** -0.5
    seqs = [(i * n, n, c, table[i].tolist()) for i in range(s.prefill_seqs)]
    tile_seq, tile_start = prefill_tiles([n] * s.prefill_seqs)
    args = [_i32(v, device) for v in (tile_seq, tile_start, [r for r, *_ in seqs], [n] * s.prefill_seqs,
                                      [c] * s.prefill_seqs, range(s.prefill_seqs))]
    bt32 = _i32(table, device)
    causal = additive_mask(torch.arange(total, device=device) <= torch.arange(c, total, device=device)[:, None], dtype)
    chunks = [(r, r + n, torch.tensor(context_slots(blocks, total, s.block_size), device=device), causal)
              for r, _, _, blocks in seqs]
    out_t, out_p = torch.empty_like(q), torch.empty_like(q)
    def triton_path() -> None:
        paged_prefill_attention(q, k_cache, v_cache, out_t, *args, bt32, scale)

    def torch_path() -> None:
        sdpa_prefill(q, k_cache, v_cache, out_p, chunks)

    want = paged_attention_ref(q, k_cache, v_cache, seqs, scale)
    triton_path()
    torch_path()
    result = {"chunks": s.prefill_seqs, "new_tokens": n, "computed": c, "max_abs_err_triton": max_err(out_t, want),
              "max_abs_err_torch": max_err(out_p, want), **compare(triton_path, torch_path, s, device)}
    # QK^T and PV over each query's causal keys (positions 0 .. c + j)
    flops = 4 * s.heads * s.head_dim * s.prefill_seqs * sum(c + j + 1 for j in range(n))
    result["triton_tflops"] = round(flops / (result["triton_us"] * 1e-6) / 1e12, 2)
    return result


def run_kernels_bench(device: str = "auto", dtype: str = "auto", quick: bool = False) -> dict:
    """Every case on one device and dtype, with that device's roofline; refused on the CPU outside the
    interpreter or without --quick (full shapes would take hours there, and mean nothing)."""
    dev = roofline.resolve_device(device)
    dt = roofline.resolve_dtype(dtype, dev)
    if dev.type == "cpu" and (os.environ.get("TRITON_INTERPRET") != "1" or not quick):
        raise ValueError("bench kernels on the CPU runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1 "
                         "and pass --quick (the times only mean something on CUDA)")
    shapes = QUICK if quick else FULL
    roof = roofline.measure(dev, dt)
    results = {"machine": roofline.machine(dev, dt), "device": str(dev), "dtype": roofline.dtype_name(dt),
               "quick": quick, "shapes": dataclasses.asdict(shapes), "roofline": roof,
               "lora": lora_cases(shapes, dev, dt),
               "attention": {f"decode_ctx{ctx}": decode_case(shapes, ctx, dev, dt, roof["mem_read_gbs"])
                             for ctx in shapes.contexts}}
    results["attention"]["prefill"] = prefill_case(shapes, dev, dt)
    if dev.type == "cpu":
        results["note"] = CPU_NOTE
    return results
