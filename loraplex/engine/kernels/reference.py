"""Plain torch references for the multi-LoRA kernels: the ground truth the Triton kernels and the
torch fast path are tested against. Slow on purpose (one token at a time), obviously correct.

Layout (one layer, one target module, stacked over device slots; see lora_ops.py for the full text):

    A        [num_slots, num_slices * r_max, in_features]   rows s*r_max .. (s+1)*r_max-1 = slice s
    B        [num_slots, out_total, r_max]                  rows off_s .. off_s+w_s-1 = slice s
    widths   (w_0, .., w_{S-1}), off_s = w_0 + .. + w_{s-1}, out_total = sum(widths)
    slot     per token, -1 = base model only (no delta)
    ranks    optional [num_slots]; columns >= ranks[slot] of a slice are zero padding

Scaling (alpha / r) is folded into B. Math is done in fp32; y (the shrink output) is fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _slot_rank(slot: int, r_max: int, ranks: torch.Tensor | None) -> int:
    return r_max if ranks is None else min(int(ranks[slot]), r_max)


def ref_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, num_slices: int = 1,
               ranks: torch.Tensor | None = None) -> torch.Tensor:
    """y[t, s*r_max + k] = sum_i x[t, i] * A[slot[t], s*r_max + k, i] for k < rank(slot[t]), else 0.

    x [T, in], A [slots, S*r_max, in], token_slots [T] -> y [T, S*r_max] fp32 (zero rows for slot -1).
    """
    r_max = lora_a.shape[1] // num_slices
    y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        rank = _slot_rank(slot, r_max, ranks)
        for s in range(num_slices):
            rows = slice(s * r_max, s * r_max + rank)
            y[t, rows] = lora_a[slot, rows].float().cpu() @ x[t].float().cpu()
    return y


def ref_expand(y: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
               slice_widths: Sequence[int], ranks: torch.Tensor | None = None) -> torch.Tensor:
    """Return a copy of out with out[t, off_s+n] += sum_k y[t, s*r_max+k] * B[slot[t], off_s+n, k].

    The sum runs over k < rank(slot[t]); the add is done in fp32 and rounded once to out's dtype.
    Tokens with slot -1 are unchanged.
    """
    r_max = lora_b.shape[2]
    res = out.detach().cpu().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        rank = _slot_rank(slot, r_max, ranks)
        off = 0
        row = res[t].float()
        for s, w in enumerate(slice_widths):
            ys = y[t, s * r_max:s * r_max + rank].float().cpu()
            row[off:off + w] += lora_b[slot, off:off + w, :rank].float().cpu() @ ys
            off += w
        res[t] = row.to(res.dtype)
    return res


def ref_lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                           token_slots: torch.Tensor, slice_widths: Sequence[int],
                           ranks: torch.Tensor | None = None) -> torch.Tensor:
    """Shrink then expand: the expected value of `out` after lora_shrink_expand (returned, not in place)."""
    y = ref_shrink(x, lora_a, token_slots, len(slice_widths), ranks)
    return ref_expand(y, lora_b, out, token_slots, slice_widths, ranks)


def segments_to_token_slots(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> torch.Tensor:
    """Per-token slots from segments: token t in [seg_starts[g], seg_starts[g+1]) gets seg_slots[g]."""
    starts = seg_starts.tolist()
    slots = seg_slots.tolist()
    token_slots = torch.full((starts[-1] if starts else 0,), -1, dtype=torch.int32)
    for g, slot in enumerate(slots):
        token_slots[starts[g]:starts[g + 1]] = slot
    return token_slots
