"""The `triton_paged` backend: the Triton paged-attention kernels (kernels/paged_attention.py).

K/V are read in place through block tables (no gather, no padding, no mask tensor), so a decode
row's cost follows its own context, not the batch's longest. Per layer: one launch for the decode
rows (plus a small merge when long contexts are split, flash-decoding) and one for all prefill
chunks. The step's index tensors are built on the host once and reach the device in one copy.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from loraplex.engine.attention.base import AttentionBackend, StepSeq, is_decode, slots_of, write_kv
from loraplex.engine.host_copy import upload

HEAD_DIM_MAX = 256


@dataclass
class PagedMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64 flat slots to write this step's K/V to
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, padded with block 0 (never read)
    decode_all: bool  # every row is a decode row
    # decode rows (None when there are none): [R] int32 each
    rows: torch.Tensor | None
    lens: torch.Tensor | None  # context length row r attends, itself included
    row_table: torch.Tensor | None  # its block-table row
    max_len: int  # host-side max(lens), to choose the split count without a device read
    # prefill chunks (None when there are none): tiles [n_tiles] and sequences [prefills], int32 each
    tile_seq: torch.Tensor | None
    tile_start: torch.Tensor | None
    seq_rows: torch.Tensor | None
    seq_new: torch.Tensor | None
    seq_computed: torch.Tensor | None
    seq_table: torch.Tensor | None


def build_paged_metadata(seqs: list[StepSeq], block_size: int, device: torch.device) -> PagedMetadata:
    """Describes a step for the kernels. seqs: per sequence in batch order (computed, new, block ids)."""
    from loraplex.engine.kernels.paged_attention import prefill_tiles

    slots: list[int] = []
    tables: list[list[int]] = []
    rows: list[int] = []
    lens: list[int] = []
    row_table: list[int] = []
    prefill: list[tuple[int, int, int, int]] = []  # (first row, new, computed, table row)
    row = 0
    for s, (computed, new, blocks) in enumerate(seqs):
        total = computed + new
        tables.append(blocks[: -(-total // block_size)])
        if is_decode(computed, new):
            rows.extend(range(row, row + new))
            lens.extend(range(computed + 1, total + 1))
            row_table.extend([s] * new)
        else:
            prefill.append((row, new, computed, s))
        slots.extend(slots_of(computed, new, blocks, block_size))
        row += new
    max_blocks = max(len(t) for t in tables)
    tile_seq, tile_start = prefill_tiles([p[1] for p in prefill])
    parts = {  # every int32 index, sent to the device in one copy, then viewed apart
        "tables": [b for t in tables for b in t + [0] * (max_blocks - len(t))],
        "rows": rows, "lens": lens, "row_table": row_table,
        "tile_seq": tile_seq, "tile_start": tile_start,
        **{name: [p[i] for p in prefill]
           for i, name in enumerate(("seq_rows", "seq_new", "seq_computed", "seq_table"))},
        "slots": slots,
    }
    views = {name: view if len(view) else None
             for name, view in zip(parts, upload(device, torch.int32, *parts.values()), strict=True)}
    return PagedMetadata(
        slot_mapping=views.pop("slots").long(),  # (int32 in the copy, as in static decode's: 2**31 slots would be TBs)
        block_tables=views.pop("tables").view(len(tables), max_blocks),
        decode_all=not prefill,
        max_len=max(lens, default=0),
        **views,
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonPagedBackend(AttentionBackend):
    name = "triton_paged"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def unsupported(self, device, dtype, head_dim):
        if device.type != "cuda" and not _interpreting():
            return f"device {device} (it needs CUDA, or TRITON_INTERPRET=1 to run in Triton's interpreter)"
        if head_dim % 16 or head_dim > HEAD_DIM_MAX:
            return f"head_dim {head_dim} (it takes multiples of 16 up to {HEAD_DIM_MAX})"
        return super().unsupported(device, dtype, head_dim)

    def build_metadata(self, seqs, block_size, device, dtype):
        return build_paged_metadata(seqs, block_size, torch.device(device))

    def forward(self, q, k, v, k_cache, v_cache, meta: PagedMetadata):
        from loraplex.engine.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

        n_tok, n_heads, head_dim = q.shape
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(n_tok, n_heads, head_dim)  # every row is a decode row or in a prefill chunk
        scale = 1.0 / math.sqrt(head_dim)
        if meta.rows is not None:
            paged_decode_attention(q, k_cache, v_cache, out, meta.rows, meta.lens, meta.row_table, meta.block_tables,
                                   scale, meta.max_len)
        if meta.tile_seq is not None:
            paged_prefill_attention(q, k_cache, v_cache, out, meta.tile_seq, meta.tile_start, meta.seq_rows,
                                    meta.seq_new, meta.seq_computed, meta.seq_table, meta.block_tables, scale)
        return out.view(n_tok, n_heads * head_dim)
