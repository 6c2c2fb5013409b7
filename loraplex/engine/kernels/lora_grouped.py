"""Grouped LoRA path for the CPU: one batched GEMM over a range of slot views, no weight copies.

Semantics (same as reference.py): for each token t with slot p >= 0,
    out[t, off_s:off_s+w_s] += B[p, off_s:off_s+w_s, :] @ (A[p, s*r:(s+1)*r, :] @ x[t])
Shapes: x [T, in]; out [T, sum(w_s)]; A [slots, S*r, in]; B [slots, sum(w_s), r].

Why: with many adapters in one decode batch, a matmul per segment costs one op dispatch per
adapter, module and layer, and gathering each token's weights copies the adapters (which can
outweigh the base model) every step. Here the tokens are padded into a [G, L, in] block, one row
group per slot of the batch's slot range [lo, hi), and A[lo:hi] / B[lo:hi] are used as views: each
adapter's weights are read once, by one bmm per slice, whatever the number of adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupLayout:
    """Where each LoRA token goes in the padded [groups, max_len] block (built once per step)."""

    lo: int  # first slot of the range
    groups: int  # hi - lo
    max_len: int  # longest run of tokens of one slot
    rows: torch.Tensor  # [groups * max_len] token row feeding each padded position; T = the zero row
    identity: bool  # rows is exactly 0..T-1 (no padding, every token has an adapter): no scatter needed


def group_layout(segments: Sequence[tuple[int, int, int]], num_tokens: int, device) -> GroupLayout:
    """segments: (start, end, slot) of the LoRA tokens, one run per slot (tokens sorted by slot)."""
    lo = min(s for _, _, s in segments)
    groups = max(s for _, _, s in segments) - lo + 1
    runs: dict[int, list[int]] = {}
    for start, end, slot in segments:
        runs.setdefault(slot - lo, []).extend(range(start, end))
    max_len = max(len(r) for r in runs.values())
    rows = torch.full((groups, max_len), num_tokens, dtype=torch.long)
    for g, toks in runs.items():
        rows[g, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    flat = rows.view(-1)
    identity = flat.numel() == num_tokens and bool(torch.equal(flat, torch.arange(num_tokens)))
    return GroupLayout(lo, groups, max_len, flat.to(device), identity)


def grouped_shrink_expand(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                          layout: GroupLayout, offs: Sequence[int], widths: Sequence[int], r_max: int,
                          ranks: torch.Tensor | None = None) -> None:
    """out += LoRA deltas of every LoRA token, in place (see the module docstring). With `ranks`,
    y beyond each slot's rank is zeroed, so whatever the padding holds never reaches `out`."""
    g, n = layout.groups, layout.max_len
    if layout.identity:
        x_pad = x.view(g, n, x.shape[1])  # [G, L, in]: the batch already is the padded block
    else:
        x_ext = torch.cat((x, x.new_zeros(1, x.shape[1])))  # [T + 1, in]: the last row pads with zeros
        x_pad = torch.index_select(x_ext, 0, layout.rows).view(g, n, x.shape[1])  # [G, L, in]
    a = lora_a[layout.lo:layout.lo + g].to(x.dtype)  # [G, S*r, in] view (a copy for weights of another dtype)
    b = lora_b[layout.lo:layout.lo + g].to(x.dtype)  # [G, out, r] view
    y = torch.bmm(x_pad, a.transpose(1, 2))  # [G, L, S*r]
    if ranks is not None:
        rk = ranks[layout.lo:layout.lo + g].to(torch.long)  # [G]
        keep = torch.arange(r_max, device=x.device).unsqueeze(0) < rk.unsqueeze(1)  # [G, r]
        if not bool(keep.all()):
            y = y * keep.repeat(1, len(widths)).unsqueeze(1).to(y.dtype)
    # Padded positions hold zero rows, so their deltas are exactly zero: adding them to the
    # (real) row `rows` names, or to row 0 for padding, changes nothing.
    rows = layout.rows.clamp(max=x.shape[0] - 1)
    for s, (off, w) in enumerate(zip(offs, widths, strict=True)):
        d = torch.bmm(y[:, :, s * r_max:(s + 1) * r_max], b[:, off:off + w].transpose(1, 2))  # [G, L, w]
        if layout.identity:
            out[:, off:off + w] += d.view(g * n, w)
        else:
            out[:, off:off + w].index_add_(0, rows, d.view(g * n, w))
