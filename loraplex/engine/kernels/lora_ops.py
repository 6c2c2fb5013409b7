"""Multi-LoRA deltas for a flat token batch: layout, batch index, input checks, torch fast path, dispatch.

Layout (one layer, one target module; device slots stacked):

    lora_a   [num_slots, num_slices * r_max, in_features]
             rows s*r_max .. (s+1)*r_max-1 hold slice s's A (rank r <= r_max; rows >= r are zero)
    lora_b   [num_slots, out_total, r_max], out_total = sum(slice_widths)
             rows off_s .. off_s+w_s-1 hold slice s's B (columns >= r are zero), scaling alpha/r folded in;
             row n of lora_b is exactly column n of the fused projection output, so B needs no
             per-slice padding even when slice widths differ (qkv with GQA).
             Stored contiguous or rank-major: a [num_slots, r_max, out_total] tensor transposed
             (`stacked_b`, `is_rank_major`). The slot buffers are rank-major, which the CPU kernel
             (cpu/lora.c) requires: an adapter of rank r reads r whole rows of out_total, never the
             padding up to r_max, so a fleet's one rank-64 adapter costs its rank-16 ones nothing.
    slices   o, down: 1 slice (w = out); gate_up: 2 equal slices; qkv: 3 slices
             (q: n_heads*head_dim, k and v: n_kv_heads*head_dim), in that order, like the fused weight.
    ranks    optional [num_slots] int: the true rank per slot; kernels skip the zero padding beyond it.
    slots    per token, int32, -1 = base model only (its output row is not touched).

The batch is described by `LoraBatchIndex`: per-token slots plus segments (maximal runs of consecutive
tokens with the same slot): seg_starts [G+1] token offsets, seg_slots [G]. The runner builds it once
per step on the host; every layer and module shares it.

Math per token t with slot p >= 0 (reference.py is the executable version):
    y[t]                    = A[p] @ x[t]                                  (fp32, [S*r_max])
    out[t, off_s:off_s+w_s] += B[p, off_s:off_s+w_s, :] @ y[t, s*r_max:(s+1)*r_max]   for each slice s
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from loraplex.engine.kernels.lora_grouped import GroupLayout, group_layout, grouped_shrink_expand

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
# Dispatch: mean tokens per LoRA segment at or above which the segment (GEMM-shaped) kernels are used;
# below it the per-token (GEMV-shaped) ones. A starting point to tune on a GPU, not a measured crossover.
SGMV_MIN_AVG_SEGMENT = 8
# CPU torch path: from this many adapter segments in one batch on, the grouped path (one bmm over slot
# views) replaces a matmul per segment.
GROUPED_MIN_SEGMENTS = 3
# CPU torch path: a segment of this many tokens or more gets its own GEMM instead of joining the group.
HEAVY_SEGMENT = 4
# Slices per fused projection the kernels take (qkv = 3, gate_up = 2, o / down = 1).
MAX_SLICES = 4


class SlotGroups(NamedTuple):
    """A batch's LoRA tokens grouped by slot (host tensors): one group per slot, however its tokens
    are spread over the batch, so a kernel reads each adapter's weights once per call."""

    rows: torch.Tensor  # [num_rows] int32 token indices, each slot's tokens together, in token order
    groups: torch.Tensor  # [num_groups, 3] int32 (slot, begin, end): tokens rows[begin:end] use slot
    num_rows: int
    num_groups: int


@dataclass(frozen=True)
class LoraBatchIndex:
    """Which adapter slot each token of a flat batch uses, as per-token slots and as segments.

    token_slots [T] int32, seg_starts [G+1] int32 (0 .. T), seg_slots [G] int32, all on one device.
    The host-side fields let dispatch and checks run without a device sync.
    """

    token_slots: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    num_tokens: int
    max_seg_len: int
    max_slot: int
    lora_segments: tuple[tuple[int, int, int], ...]  # (start, end, slot) of segments with slot >= 0
    num_lora_tokens: int

    @classmethod
    def from_token_slots(cls, token_slots: Sequence[int] | torch.Tensor,
                         device: torch.device | str | None = None) -> LoraBatchIndex:
        slots = token_slots.tolist() if isinstance(token_slots, torch.Tensor) else list(token_slots)
        lens: list[int] = []
        seg_slots: list[int] = []
        for s in slots:
            if seg_slots and seg_slots[-1] == s:
                lens[-1] += 1
            else:
                lens.append(1)
                seg_slots.append(s)
        return cls.from_segments(lens, seg_slots, device)

    @classmethod
    def from_segments(cls, seg_lens: Sequence[int], seg_slots: Sequence[int],
                      device: torch.device | str | None = None) -> LoraBatchIndex:
        """Segments in token order (e.g. one per request); adjacent segments of one slot are merged."""
        if len(seg_lens) != len(seg_slots):
            raise ValueError(f"seg_lens has {len(seg_lens)} entries but seg_slots has {len(seg_slots)}")
        starts, slots, token_slots = [0], [], []
        for n, s in zip(seg_lens, seg_slots, strict=True):
            n, s = int(n), int(s)
            if n < 0 or s < -1:
                raise ValueError(f"segment length must be >= 0 and slot >= -1, got length {n}, slot {s}")
            token_slots += [s] * n
            if n == 0:
                continue
            if slots and slots[-1] == s:
                starts[-1] += n
            else:
                slots.append(s)
                starts.append(starts[-1] + n)
        bounds = [(starts[g], starts[g + 1], s) for g, s in enumerate(slots)]
        lora = tuple(b for b in bounds if b[2] >= 0)

        def _t(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int32, device=device)

        return cls(token_slots=_t(token_slots), seg_starts=_t(starts), seg_slots=_t(slots),
                   num_tokens=starts[-1], max_seg_len=max((e - b for b, e, _ in bounds), default=0),
                   max_slot=max(slots, default=-1), lora_segments=lora,
                   num_lora_tokens=sum(e - b for b, e, _ in lora))

    @functools.cached_property
    def heavy_segments(self) -> tuple[tuple[int, int, int], ...]:
        """LoRA segments long enough for a GEMM of their own (the CPU torch path's split)."""
        return tuple(seg for seg in self.lora_segments if seg[1] - seg[0] >= HEAVY_SEGMENT)

    @functools.cached_property
    def grouped_layout(self) -> GroupLayout | None:
        """The padded layout of lora_grouped.py for the short segments, when it is the better CPU
        path: several adapters, one run of tokens per slot, over a slot range not much wider than
        the slots used. Long segments stay out of it: padding every slot to their length would
        multiply the work."""
        segs = [seg for seg in self.lora_segments if seg[1] - seg[0] < HEAVY_SEGMENT]
        slots = {s for _, _, s in segs}
        if len(segs) < GROUPED_MIN_SEGMENTS or len(slots) != len(segs):
            return None
        if max(slots) - min(slots) + 1 > 2 * len(slots) + 8:  # unused slots in the range cost reads
            return None
        return group_layout(segs, self.num_tokens, self.token_slots.device)

    @functools.cached_property
    def slot_groups(self) -> SlotGroups:
        """The LoRA tokens grouped by slot, for the CPU C kernel (cpu/lora.c), built once per step."""
        by_slot: dict[int, list[int]] = {}
        for start, end, slot in self.lora_segments:
            by_slot.setdefault(slot, []).extend(range(start, end))
        rows: list[int] = []
        groups: list[tuple[int, int, int]] = []
        for slot, toks in by_slot.items():
            groups.append((slot, len(rows), len(rows) + len(toks)))
            rows += toks
        return SlotGroups(torch.tensor(rows, dtype=torch.int32),
                          torch.tensor(groups, dtype=torch.int32).reshape(len(groups), 3), len(rows), len(groups))

    @property
    def prefers_segments(self) -> bool:
        """True for prefill-shaped batches (long segments), False for decode-shaped ones."""
        n = len(self.lora_segments)
        return n > 0 and self.num_lora_tokens >= SGMV_MIN_AVG_SEGMENT * n


# ----------------------------------------------------------------------------------------- checks

def stacked_b(num_slots: int, out_total: int, r_max: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> torch.Tensor:
    """A zeroed lora_b [num_slots, out_total, r_max] in the rank-major layout (storage [num_slots, r_max,
    out_total]) that the slot buffers use and cpu/lora.c requires."""
    return torch.zeros(num_slots, r_max, out_total, dtype=dtype, device=device).transpose(1, 2)


def is_rank_major(lora_b: torch.Tensor) -> bool:
    """True when lora_b [slots, out_total, r_max] is a view of contiguous [slots, r_max, out_total] storage."""
    return lora_b.dim() == 3 and lora_b.transpose(1, 2).is_contiguous()


def _check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...],
                  rank_major_ok: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if not t.is_contiguous() and not (rank_major_ok and is_rank_major(t)):
        also = " or rank-major (stacked_b)" if rank_major_ok else ""
        raise ValueError(f"{name} must be contiguous (call .contiguous()){also}, got strides {t.stride()}")
    return t


def _same_device(ref: torch.Tensor, **named: torch.Tensor | None) -> None:
    for name, t in named.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but the inputs are on {ref.device}")


def _check_ranks(ranks: torch.Tensor | None, num_slots: int, ref: torch.Tensor) -> None:
    if ranks is None:
        return
    _check_tensor("ranks", ranks, 1, INDEX_DTYPES)
    _same_device(ref, ranks=ranks)
    if ranks.shape[0] != num_slots:
        raise ValueError(f"ranks must have one entry per slot ({num_slots}), got {ranks.shape[0]}")
    if ranks.device.type == "cpu" and ranks.numel() and int(ranks.min()) < 0:
        raise ValueError(f"ranks must be >= 0, got {ranks.tolist()}")


def check_a(lora_a: torch.Tensor, num_slices: int, ranks: torch.Tensor | None) -> int:
    """Validate stacked A [slots, S*r_max, in]; return r_max."""
    _check_tensor("lora_a", lora_a, 3, FLOAT_DTYPES)
    if num_slices < 1 or lora_a.shape[1] % num_slices:
        raise ValueError(f"lora_a rows ({lora_a.shape[1]}) are not a multiple of num_slices={num_slices}")
    _check_ranks(ranks, lora_a.shape[0], lora_a)
    return lora_a.shape[1] // num_slices


def check_b(lora_b: torch.Tensor, num_slices: int, slice_widths: Sequence[int] | None,
            ranks: torch.Tensor | None) -> tuple[int, ...]:
    """Validate stacked B [slots, out_total, r_max] (contiguous or rank-major) against num_slices; return the
    slice widths."""
    _check_tensor("lora_b", lora_b, 3, FLOAT_DTYPES, rank_major_ok=True)
    out_total = lora_b.shape[1]
    if slice_widths is None:
        if out_total % num_slices:
            raise ValueError(f"lora_b rows ({out_total}) do not split into {num_slices} equal slices; "
                             "pass slice_widths")
        slice_widths = [out_total // num_slices] * num_slices
    widths = tuple(int(w) for w in slice_widths)
    if len(widths) != num_slices or any(w < 1 for w in widths) or sum(widths) != out_total:
        raise ValueError(f"slice_widths {widths} must be {num_slices} positive widths summing to "
                         f"lora_b.shape[1] = {out_total}")
    if num_slices > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} slices per fused projection, got {num_slices}")
    _check_ranks(ranks, lora_b.shape[0], lora_b)
    return widths


def check_weights(lora_a: torch.Tensor, lora_b: torch.Tensor, slice_widths: Sequence[int] | None,
                  ranks: torch.Tensor | None) -> tuple[int, int, tuple[int, ...]]:
    """Validate stacked A and B together; return (num_slices, r_max, slice_widths)."""
    _check_tensor("lora_a", lora_a, 3, FLOAT_DTYPES)
    _check_tensor("lora_b", lora_b, 3, FLOAT_DTYPES, rank_major_ok=True)
    _same_device(lora_a, lora_b=lora_b)
    if lora_b.dtype != lora_a.dtype:
        raise ValueError(f"lora_b dtype {lora_b.dtype} differs from lora_a dtype {lora_a.dtype}")
    if lora_b.shape[0] != lora_a.shape[0]:
        raise ValueError(f"lora_a has {lora_a.shape[0]} slots but lora_b has {lora_b.shape[0]}")
    r_max = lora_b.shape[2]
    if r_max < 1 or lora_a.shape[1] % r_max:
        raise ValueError(f"lora_a rows ({lora_a.shape[1]}) must be num_slices * r_max "
                         f"(r_max = lora_b.shape[2] = {r_max})")
    num_slices = lora_a.shape[1] // r_max
    check_a(lora_a, num_slices, ranks)
    return num_slices, r_max, check_b(lora_b, num_slices, slice_widths, ranks)


def check_x(x: torch.Tensor, lora_a: torch.Tensor) -> None:
    """x may have another float dtype than the weights (16-bit slots under an fp32 model): every path
    multiplies them in one dtype (the torch path x's, the kernels fp32)."""
    _check_tensor("x", x, 2, FLOAT_DTYPES)
    _same_device(lora_a, x=x)
    if x.shape[1] != lora_a.shape[2]:
        raise ValueError(f"x has {x.shape[1]} features but lora_a expects in_features={lora_a.shape[2]}")


def check_y(y: torch.Tensor, num_tokens: int, cols: int, device: torch.device) -> None:
    _check_tensor("y", y, 2, (torch.float32,))
    if tuple(y.shape) != (num_tokens, cols):
        raise ValueError(f"y must have shape ({num_tokens}, {cols}) (fp32), got {tuple(y.shape)}")
    if y.device != device:
        raise ValueError(f"y is on {y.device} but the inputs are on {device}")


def check_out(out: torch.Tensor, num_tokens: int, lora_b: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """dtype: what out must hold (the activations'), or None for any float dtype."""
    _check_tensor("out", out, 2, FLOAT_DTYPES)
    _same_device(lora_b, out=out)
    if tuple(out.shape) != (num_tokens, lora_b.shape[1]):
        raise ValueError(f"out must have shape ({num_tokens}, {lora_b.shape[1]}) = (tokens, sum of "
                         f"slice widths), got {tuple(out.shape)}")
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"out dtype {out.dtype} differs from x dtype {dtype}")


def check_token_slots(token_slots: torch.Tensor, num_tokens: int, num_slots: int, device: torch.device,
                      check_values: bool | None) -> None:
    _check_tensor("token_slots", token_slots, 1, INDEX_DTYPES)
    if token_slots.device != device:
        raise ValueError(f"token_slots is on {token_slots.device} but the inputs are on {device}")
    if token_slots.shape[0] != num_tokens:
        raise ValueError(f"token_slots has {token_slots.shape[0]} entries for {num_tokens} tokens")
    if (device.type == "cpu" if check_values is None else check_values) and num_tokens:
        lo, hi = int(token_slots.min()), int(token_slots.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"token_slots values must be in [-1, {num_slots}), got [{lo}, {hi}]")


def check_segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor, num_tokens: int, num_slots: int,
                   device: torch.device, check_values: bool | None) -> None:
    """Shapes always; values (0 = start <= .. <= end = T, slots in [-1, num_slots)) on CPU or if asked."""
    _check_tensor("seg_starts", seg_starts, 1, INDEX_DTYPES)
    _check_tensor("seg_slots", seg_slots, 1, INDEX_DTYPES)
    for name, t in (("seg_starts", seg_starts), ("seg_slots", seg_slots)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the inputs are on {device}")
    if seg_starts.shape[0] != seg_slots.shape[0] + 1:
        raise ValueError(f"seg_starts must have num_segments + 1 = {seg_slots.shape[0] + 1} entries, "
                         f"got {seg_starts.shape[0]}")
    if not (device.type == "cpu" if check_values is None else check_values):
        return
    starts = seg_starts.tolist()
    rising = all(b <= e for b, e in zip(starts[:-1], starts[1:], strict=True))
    if starts[0] != 0 or starts[-1] != num_tokens or not rising:
        raise ValueError(f"seg_starts must rise from 0 to the token count {num_tokens}, got {starts}")
    if seg_slots.numel():
        lo, hi = int(seg_slots.min()), int(seg_slots.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"seg_slots values must be in [-1, {num_slots}), got [{lo}, {hi}]")


def check_call(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               index: LoraBatchIndex, slice_widths: Sequence[int] | None,
               ranks: torch.Tensor | None) -> tuple[int, int, tuple[int, ...]]:
    """x and out share one dtype; the weights may have another (check_x)."""
    if not isinstance(index, LoraBatchIndex):
        raise ValueError(f"index must be a LoraBatchIndex, got {type(index).__name__}")
    dims = check_weights(lora_a, lora_b, slice_widths, ranks)
    check_x(x, lora_a)
    check_out(out, x.shape[0], lora_b, x.dtype)
    if index.num_tokens != x.shape[0]:
        raise ValueError(f"index describes {index.num_tokens} tokens but x has {x.shape[0]}")
    if index.max_slot >= lora_a.shape[0]:
        raise ValueError(f"index uses slot {index.max_slot} but there are {lora_a.shape[0]} slots")
    _same_device(x, token_slots=index.token_slots)
    return dims


def check_expand(y: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, slice_widths: Sequence[int] | None,
                 ranks: torch.Tensor | None) -> tuple[int, int, tuple[int, ...]]:
    """Validate expand inputs; the slice count comes from y's width (S * r_max). Return (S, r_max, widths)."""
    _check_tensor("lora_b", lora_b, 3, FLOAT_DTYPES, rank_major_ok=True)
    _check_tensor("y", y, 2, (torch.float32,))
    r_max = lora_b.shape[2]
    if r_max < 1 or y.shape[1] % r_max:
        raise ValueError(f"y columns ({y.shape[1]}) must be num_slices * r_max "
                         f"(r_max = lora_b.shape[2] = {r_max})")
    num_slices = y.shape[1] // r_max
    widths = check_b(lora_b, num_slices, slice_widths, ranks)
    check_out(out, y.shape[0], lora_b)  # (out's dtype may differ from B's)
    check_y(y, out.shape[0], num_slices * r_max, out.device)
    return num_slices, r_max, widths


# ------------------------------------------------------------------------------------ torch path

def lora_shrink_expand_torch(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                             index: LoraBatchIndex, *, slice_widths: Sequence[int] | None = None,
                             ranks: torch.Tensor | None = None, kernel: str = "auto") -> None:
    """Torch-ops version of lora_shrink_expand (CPU serving): out += LoRA deltas, in place.

    kernel "segments": per contiguous segment, mm on views (prefill-shaped); "gather": one bmm over
    per-token gathered weights (decode-shaped); "grouped": one bmm per slice over slot views with
    tokens padded per slot (many adapters, see lora_grouped.py); "auto" takes grouped when the index
    allows it, else picks by index.prefers_segments.
    Math runs in x's dtype (fp32 on CPU by default); weights of another dtype (16-bit slots under an
    fp32 model) are cast to it as they are used.
    """
    num_slices, r_max, widths = check_call(x, out, lora_a, lora_b, index, slice_widths, ranks)
    if kernel not in ("auto", "segments", "gather", "grouped"):
        raise ValueError(f"kernel must be 'auto', 'segments', 'gather' or 'grouped', got {kernel!r}")
    if index.num_lora_tokens == 0:
        return
    offs = [sum(widths[:s]) for s in range(num_slices)]
    if kernel == "grouped" and index.grouped_layout is None:
        raise ValueError("kernel 'grouped' needs short runs of one token group per slot over a compact slot range")
    if kernel in ("auto", "grouped") and index.grouped_layout is not None:
        grouped_shrink_expand(x, out, lora_a, lora_b, index.grouped_layout, offs, widths, r_max, ranks)
        _segment_gemms(x, out, lora_a, lora_b, index.heavy_segments, offs, widths, r_max, ranks)
        return
    if kernel == "segments" or (kernel == "auto" and index.prefers_segments):
        _segment_gemms(x, out, lora_a, lora_b, index.lora_segments, offs, widths, r_max, ranks)
        return
    sel = torch.nonzero(index.token_slots >= 0).squeeze(1)
    slots = index.token_slots[sel].long()
    y = torch.bmm(lora_a[slots].to(x.dtype), x[sel].unsqueeze(2))  # [n, S*r_max, 1]
    if ranks is not None:
        keep = torch.arange(r_max, device=x.device) < ranks[slots].unsqueeze(1)  # [n, r_max]
        y = y * keep.repeat(1, num_slices).unsqueeze(2).to(y.dtype)
    delta = torch.empty(sel.shape[0], out.shape[1], dtype=out.dtype, device=out.device)
    for s, (off, w) in enumerate(zip(offs, widths, strict=True)):
        ys = y[:, s * r_max:(s + 1) * r_max]
        delta[:, off:off + w] = torch.bmm(lora_b[slots, off:off + w].to(x.dtype), ys).squeeze(2)
    out.index_add_(0, sel, delta)


def _segment_gemms(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   segments: Sequence[tuple[int, int, int]], offs: Sequence[int], widths: Sequence[int], r_max: int,
                   ranks: torch.Tensor | None) -> None:
    """A GEMM per segment on views of its slot's weights (shrink all slices at once, expand per slice)."""
    rank_list = ranks.tolist() if ranks is not None and segments else None
    for start, end, slot in segments:
        rk = r_max if rank_list is None else max(0, min(int(rank_list[slot]), r_max))
        if rk == 0:
            continue
        xs, a, b = x[start:end], lora_a[slot].to(x.dtype), lora_b[slot].to(x.dtype)
        y = xs @ a.t() if rk == r_max else None  # all slices in one GEMM when there is no padding
        for s, (off, w) in enumerate(zip(offs, widths, strict=True)):
            lo = s * r_max
            ys = y[:, lo:lo + r_max] if y is not None else xs @ a[lo:lo + rk].t()
            out[start:end, off:off + w].addmm_(ys, b[off:off + w, :rk].t())


# -------------------------------------------------------------------------------------- dispatch

def triton_available(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       index: LoraBatchIndex, *, slice_widths: Sequence[int] | None = None,
                       ranks: torch.Tensor | None = None, kernel: str = "auto") -> None:
    """Triton version: out += LoRA deltas in place, shrink then expand, one launch each.

    kernel "sgmv" (segments, prefill-shaped), "bgmv" (per token, decode-shaped) or "auto"
    (by index.prefers_segments). x [T, in], out [T, out_total] (one dtype), weights as in the module
    docstring, of x's dtype or another (both upcast to fp32 then).
    """
    num_slices, _, widths = check_call(x, out, lora_a, lora_b, index, slice_widths, ranks)
    if kernel not in ("auto", "sgmv", "bgmv"):
        raise ValueError(f"kernel must be 'auto', 'sgmv' or 'bgmv', got {kernel!r}")
    if not triton_available(x.device):
        raise ValueError(f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1), x is on {x.device}; "
                         "use lora_shrink_expand_torch")
    if index.num_lora_tokens == 0:
        return
    if kernel == "sgmv" or (kernel == "auto" and index.prefers_segments):
        from loraplex.engine.kernels.sgmv import sgmv_expand, sgmv_shrink

        seg = dict(seg_starts=index.seg_starts, seg_slots=index.seg_slots, max_seg_len=index.max_seg_len,
                   ranks=ranks, check_values=False)
        y = sgmv_shrink(x, lora_a, num_slices=num_slices, **seg)
        sgmv_expand(y, lora_b, out, slice_widths=widths, **seg)
    else:
        from loraplex.engine.kernels.bgmv import bgmv_expand, bgmv_shrink

        y = bgmv_shrink(x, lora_a, index.token_slots, num_slices=num_slices, ranks=ranks, check_values=False)
        bgmv_expand(y, lora_b, out, index.token_slots, slice_widths=widths, ranks=ranks, check_values=False)


def bgmv_shrink_expand(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       token_slots: torch.Tensor, *, slice_widths: Sequence[int], ranks: torch.Tensor | None) -> None:
    """Graph-safe out += LoRA deltas: BGMV shrink then expand over a device per-token slot tensor (-1 = none).

    No LoraBatchIndex, no host read of the slots (their values are not checked), fixed grids from the
    shapes alone: what a captured static decode step (engine/static_decode.py) launches. x [T, in],
    out [T, out_total], token_slots [T] int32; weights as in the module docstring.
    """
    from loraplex.engine.kernels.bgmv import bgmv_expand, bgmv_shrink

    num_slices, _, widths = check_weights(lora_a, lora_b, slice_widths, ranks)
    y = bgmv_shrink(x, lora_a, token_slots, num_slices=num_slices, ranks=ranks, check_values=False)  # [T, S*r]
    bgmv_expand(y, lora_b, out, token_slots, slice_widths=widths, ranks=ranks, check_values=False)


@functools.cache
def cpu_lora_kernel():
    """cpu/lora.c's wrapper when the C kernels are built on this machine, else None (torch ops)."""
    from loraplex.engine.kernels.cpu.lora import lora_available, lora_shrink_expand_cpu

    return lora_shrink_expand_cpu if lora_available() else None


def apply_lora(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               index: LoraBatchIndex, *, slice_widths: Sequence[int] | None = None,
               ranks: torch.Tensor | None = None) -> None:
    """What a model layer calls: Triton kernels on CUDA; on the CPU the C kernel (cpu/lora.c) for
    fp32 and a rank-major B (the slot buffers') when it is built, torch ops otherwise (no compiler,
    LORAPLEX_CPU_KERNELS=0, other dtypes, a contiguous B)."""
    if x.is_cuda:
        fn = lora_shrink_expand
    elif x.is_cpu and x.dtype is torch.float32 and lora_b.stride(1) == 1 and (cpu := cpu_lora_kernel()) is not None:
        fn = cpu
    else:
        fn = lora_shrink_expand_torch
    fn(x, out, lora_a, lora_b, index, slice_widths=slice_widths, ranks=ranks)
