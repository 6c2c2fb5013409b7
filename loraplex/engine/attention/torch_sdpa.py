"""The `torch_sdpa` backend: torch's scaled_dot_product_attention over K/V gathered from the cache.

- Runs on any device and dtype, and is the reference the other backends are held to.
- K/V are read in the cache's dtype and widened (8-bit rows: dequantized) to the model's after the
  gather; a first chunk, which takes its K/V from the step rather than the cache, rounds them as the cache
  does, so a prompt attends the same values whether computed at once, in chunks, after a prefix-cache hit
  or again after preemption.
- Decode rows are attended together in one padded SDPA call over their gathered blocks; prefill chunks
  one sequence at a time (their query lengths differ widely: padding would waste most of the work).
- Every row's K/V is written before any row attends, so a draft row sees exactly the tokens before it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.engine.attention.base import AttentionBackend, StepSeq, is_decode, slots_of, write_kv
from loraplex.engine.kv.kv_dtype import dequantize, quantize, raw


@dataclass
class PrefillSeq:
    """One sequence's prefill chunk: token rows [start, end) of the batch."""

    start: int
    end: int
    # Flat cache slots of the whole context (earlier tokens and this chunk) [context], or None
    # when the chunk is the whole context (no earlier tokens): then K/V come straight from the chunk.
    gather: torch.Tensor | None
    # [chunk, context] additive mask: 0 where a query may attend (causal, aligned to the end), -inf
    # elsewhere; or None.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] flat slot (block * block_size + offset) to write K/V to
    decode_rows: torch.Tensor | None  # [decodes] token rows that are single-token decodes
    decode_all: bool  # every token of the batch is a decode (rows are 0..n-1)
    # Block tables of the decodes [decodes, max_blocks], padded with block 0 (masked out): K/V are
    # gathered a whole block at a time, far cheaper than slot by slot.
    decode_blocks: torch.Tensor | None
    prefills: list[PrefillSeq]
    decode_lens: torch.Tensor | None = None  # [decodes] int64 context lengths (this token included)
    decode_max_len: int = 0
    block_size: int = 1
    dtype: torch.dtype = torch.float32  # the model's, for decode_mask

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """[decodes, 1, 1, max_blocks * block_size] additive: 0 on real context, -inf on padding.
        Built on first use, once per step in the model dtype (so no layer converts a boolean mask
        again), and only by the torch decode path: the CPU kernel reads the lengths instead."""
        if self.decode_lens is None:
            return None
        pos = torch.arange(self.decode_blocks.shape[1] * self.block_size, device=self.decode_lens.device)
        allowed = pos.unsqueeze(0) < self.decode_lens.unsqueeze(1)
        return _additive(allowed, self.dtype).view(allowed.shape[0], 1, 1, -1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def build_metadata(seqs: list[StepSeq], block_size: int, device: torch.device | str,
                   dtype: torch.dtype = torch.float32) -> AttentionMetadata:
    """Describes a step. seqs: per sequence in batch order (num_computed, num_new, block_ids)."""
    device = torch.device(device)
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_seqs: list[tuple[int, list[int]]] = []  # (context length, blocks)
    prefills: list[PrefillSeq] = []
    row = 0
    for computed, new, blocks in seqs:
        total = computed + new
        if is_decode(computed, new):  # each token a decode row over the context before it
            decode_rows.extend(range(row, row + new))
            decode_seqs.extend((p + 1, blocks) for p in range(computed, total))
        elif computed == 0:
            prefills.append(PrefillSeq(row, row + new, None, None))
        else:
            ctx = torch.tensor(slots_of(0, total, blocks, block_size), device=device)
            q_pos = torch.arange(computed, total, device=device).unsqueeze(1)
            k_pos = torch.arange(total, device=device).unsqueeze(0)
            prefills.append(PrefillSeq(row, row + new, ctx, _additive(k_pos <= q_pos, dtype)))
        slots.extend(slots_of(computed, new, blocks, block_size))
        row += new
    dec_blocks = dec_rows = lens = None
    if decode_seqs:
        max_blocks = -(-max(c for c, _ in decode_seqs) // block_size)
        table = [b[: -(-c // block_size)] for c, b in decode_seqs]
        dec_blocks = torch.tensor([t + [0] * (max_blocks - len(t)) for t in table], dtype=torch.long, device=device)
        lens = torch.tensor([c for c, _ in decode_seqs], device=device)
        dec_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decode_rows=dec_rows,
        decode_all=not prefills and bool(decode_rows),
        decode_blocks=dec_blocks,
        prefills=prefills,
        decode_lens=lens,
        decode_max_len=max((c for c, _ in decode_seqs), default=0),
        block_size=block_size,
        dtype=dtype,
    )


def gather(cache: torch.Tensor, index: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """cache[index] along dim 0 (a cache's [..., row width] rows) as q's dtype [..., head_dim]."""
    return dequantize(torch.index_select(raw(cache), 0, index).view(cache.dtype), q.shape[-1], q.dtype)


class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def build_metadata(self, seqs, block_size, device, dtype):
        return build_metadata(seqs, block_size, device, dtype)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        n_tok, n_heads, head_dim = q.shape
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_all:
            return self.decode(q, k_cache, v_cache, meta).reshape(n_tok, n_heads * head_dim)
        out = q.new_empty(n_tok, n_heads, head_dim)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self.decode(q[meta.decode_rows], k_cache, v_cache, meta)
        gqa = n_heads != k.shape[1]
        if k_cache.dtype != q.dtype and any(p.gather is None for p in meta.prefills):
            # a first chunk attends its own K/V as the cache holds them, as every later step will
            k, v = (dequantize(quantize(t, k_cache.dtype), head_dim, q.dtype) for t in (k, v))
        k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [slots, kv_heads, row width]
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        for p in meta.prefills:
            # [1, heads, chunk, head_dim]: 4-D, so the fused SDPA kernels (flash, memory-efficient) may take it
            qs = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
            if p.gather is None:
                ks = k[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, chunk, head_dim]
                vs = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            else:
                ks = gather(k_flat, p.gather, q).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
                vs = gather(v_flat, p.gather, q).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, enable_gqa=gqa)
            out[p.start:p.end] = o[0].transpose(0, 1)
        return out.view(n_tok, n_heads * head_dim)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows' attention: q [decodes, heads, head_dim] -> [decodes, heads, head_dim]."""
        n, n_kv, head_dim = q.shape[0], k_cache.shape[2], q.shape[2]
        qd = q.unsqueeze(2)  # [decodes, heads, 1, head_dim]
        # [decodes, max_blocks, block_size, kv_heads, head_dim] -> [decodes, kv_heads, context, head_dim]
        # index_select copies whole rows, several times faster than advanced indexing on CPU
        blocks = meta.decode_blocks.view(-1)
        kd = gather(k_cache, blocks, q).view(n, -1, n_kv, head_dim).transpose(1, 2)
        vd = gather(v_cache, blocks, q).view(n, -1, n_kv, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=q.shape[1] != n_kv)
        return o.squeeze(2)
