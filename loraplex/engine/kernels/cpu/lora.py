"""Multi-LoRA deltas on the CPU through lora.c (see its Semantics): shrink then expand in one call.

x and out are fp32; the slot buffers A and B are fp32, bf16 or fp16 (lora_weights.h: 16-bit weights are
widened as they are loaded, which halves the memory traffic of many-adapter steps).
apply_lora (kernels/lora_ops.py) uses it for fp32 CPU activations when the C kernels are built. The model
calls it 4 times per layer and step, so the wrapper stays at a few microseconds: the inputs are
checked with attribute reads only (the detailed messages are worked out once a check has failed),
the batch layout comes from the index's cached `slot_groups`, and the arguments cross into C packed
in one int64 block (one ctypes argument instead of sixteen).
"""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Sequence

import torch

from loraplex.engine.kernels.cpu.build import function
from loraplex.engine.kernels.lora_ops import MAX_SLICES, LoraBatchIndex, is_rank_major

MAX_RANK = 256  # lora.c's bound on r_max (its stack buffers)
F32, I32 = torch.float32, torch.int32
# lora.c's builds, one per slot buffers' element type (build.WEIGHT_CODES): dtype -> its entry point's suffix
WEIGHT_KERNELS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# lp_lora_*_packed's argument block per slice count: 15 int64 fields, then the slice widths
_PACKED = {s: struct.Struct(f"{15 + s}q") for s in range(1, MAX_SLICES + 1)}
_WIDTHS: dict[tuple, tuple[int, ...]] = {}  # (slice_widths, A rows, B rows, r_max) -> checked widths
_ERRORS = {-1: "invalid sizes", -2: "the index's groups do not fit the batch or the slots", -3: "out of memory"}


@functools.cache
def _lora(dtype: torch.dtype = F32):
    return function(f"lp_lora_{WEIGHT_KERNELS[dtype]}_packed", ctypes.c_int, [ctypes.c_void_p])


def lora_available() -> bool:
    """True when lora.c is built and loaded (a C compiler, LORAPLEX_CPU_KERNELS not 0)."""
    return _lora() is not None


def lora_shrink_expand_cpu(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                           index: LoraBatchIndex, *, slice_widths: Sequence[int] | None = None,
                           ranks: torch.Tensor | None = None) -> None:
    """out += the LoRA delta of every token with a slot, in place (lora_ops' semantics).

    x [T, in], out [T, out_total] float32, lora_a [slots, S * r_max, in], lora_b [slots, out_total, r_max]
    float32, bfloat16 or float16 (one dtype), all on the CPU,
    lora_b rank-major (lora_ops.stacked_b, as the slot buffers hold it), the others
    contiguous; slice_widths: S widths summing to out_total (default: equal);
    ranks: optional [slots] int32/int64, each slot's true rank (clamped to [0, r_max]).
    Raises ValueError for bad inputs, RuntimeError when the C kernels are not built.
    """
    kernel = _lora(lora_a.dtype) if getattr(lora_a, "dtype", None) in WEIGHT_KERNELS else _lora()
    if kernel is None:
        raise RuntimeError("the CPU kernels are not built (see loraplex.engine.kernels.cpu.build)")
    try:  # the common case in attribute reads; anything odd goes to _explain for a precise message
        ok = (x.dtype is F32 and out.dtype is F32 and lora_b.dtype is lora_a.dtype and lora_a.dtype in WEIGHT_KERNELS
              and x.is_contiguous() and out.is_contiguous() and lora_a.is_contiguous()
              and x.is_cpu and out.is_cpu and lora_a.is_cpu and lora_b.is_cpu)
        t, k = x.shape
        num_slots, a_rows, a_in = lora_a.shape
        b_slots, n_out, r_max = lora_b.shape
        ok = ok and out.shape == (t, n_out) and b_slots == num_slots and a_in == k and 1 <= r_max <= MAX_RANK \
            and (lora_b.stride() == (r_max * n_out, 1, n_out) or is_rank_major(lora_b))
    except (AttributeError, ValueError, TypeError):
        ok = False
    if not ok:
        _explain(x, out, lora_a, lora_b)
    widths = _WIDTHS.get((slice_widths, a_rows, n_out, r_max)) if type(slice_widths) is tuple else None
    if widths is None:
        widths = _widths(slice_widths, a_rows, n_out, r_max)
    if not isinstance(index, LoraBatchIndex):
        raise ValueError(f"index must be a LoraBatchIndex, got {type(index).__name__}")
    if index.num_tokens != t:
        raise ValueError(f"index describes {index.num_tokens} tokens but x has {t}")
    if index.max_slot >= num_slots:
        raise ValueError(f"index uses slot {index.max_slot} but there are {num_slots} slots")
    if ranks is not None and not (type(ranks) is torch.Tensor and ranks.dtype is I32 and ranks.is_cpu
                                  and ranks.is_contiguous() and ranks.shape == (num_slots,)):
        ranks = _ranks(ranks, num_slots)
    if index.num_lora_tokens == 0:
        return
    g = index.slot_groups  # rows [n] int32 token indices, groups [G, 3] int32 (slot, begin, end)
    args = _PACKED[len(widths)].pack(x.data_ptr(), out.data_ptr(), t, k, n_out, lora_a.data_ptr(), lora_b.data_ptr(),
                                     num_slots, r_max, 0 if ranks is None else ranks.data_ptr(), g.rows.data_ptr(),
                                     g.num_rows, g.groups.data_ptr(), g.num_groups, len(widths), *widths)
    rc = kernel(args)
    if rc:
        raise ValueError(f"lp_lora_{WEIGHT_KERNELS[lora_a.dtype]} refused the call: {_ERRORS.get(rc, rc)}")


def _widths(slice_widths: Sequence[int] | None, a_rows: int, n_out: int, r_max: int) -> tuple[int, ...]:
    """The slice widths (default: equal slices), checked against A's rows and B's outputs."""
    if a_rows % r_max:
        raise ValueError(f"lora_a rows ({a_rows}) must be num_slices * r_max (r_max = lora_b.shape[2] = {r_max})")
    num_slices = a_rows // r_max
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"1 to {MAX_SLICES} slices per fused projection, got {num_slices}")
    if slice_widths is None:
        if n_out % num_slices:
            raise ValueError(f"lora_b rows ({n_out}) do not split into {num_slices} equal slices; pass slice_widths")
        return (n_out // num_slices,) * num_slices
    widths = tuple(int(w) for w in slice_widths)
    if len(widths) != num_slices or sum(widths) != n_out or min(widths) < 1:
        raise ValueError(f"slice_widths {widths} must be {num_slices} positive widths summing to "
                         f"lora_b.shape[1] = {n_out}")
    if type(slice_widths) is tuple and len(_WIDTHS) < 1024:  # the model's few fused modules, checked once
        _WIDTHS[(slice_widths, a_rows, n_out, r_max)] = widths
    return widths


def _ranks(ranks: object, num_slots: int) -> torch.Tensor:
    """ranks as the int32 [slots] CPU tensor lora.c reads (int64 is converted)."""
    if not isinstance(ranks, torch.Tensor) or ranks.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ranks must be an int32 or int64 tensor, got {getattr(ranks, 'dtype', type(ranks))}")
    if ranks.dim() != 1 or ranks.shape[0] != num_slots:
        raise ValueError(f"ranks must have shape ({num_slots},) (one entry per slot), got {tuple(ranks.shape)}")
    if not ranks.is_contiguous() or not ranks.is_cpu:
        raise ValueError(f"ranks must be a contiguous CPU tensor, got strides {ranks.stride()} on {ranks.device}")
    return ranks if ranks.dtype is torch.int32 else ranks.to(torch.int32)


def _explain(x: object, out: object, lora_a: object, lora_b: object) -> None:
    """Raises ValueError naming what is wrong with the tensors (called once the fast check failed)."""
    for name, t, ndim in (("x", x, 2), ("out", out, 2), ("lora_a", lora_a, 3), ("lora_b", lora_b, 3)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name in ("x", "out") and t.dtype != F32:
            raise ValueError(f"{name} must be float32 for the CPU LoRA kernel, got {t.dtype}")
        if name.startswith("lora") and t.dtype not in WEIGHT_KERNELS:
            raise ValueError(f"{name} must be float32, bfloat16 or float16 for the CPU LoRA kernel, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
        if name == "lora_b" and not is_rank_major(t):
            raise ValueError(f"lora_b must be rank-major (lora_ops.stacked_b: storage [slots, r_max, out_total] "
                             f"transposed), got strides {t.stride()}")
        if name != "lora_b" and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
        if not t.is_cpu:
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if lora_b.dtype != lora_a.dtype:
        raise ValueError(f"lora_b dtype {lora_b.dtype} differs from lora_a dtype {lora_a.dtype}")
    if lora_b.shape[0] != lora_a.shape[0]:
        raise ValueError(f"lora_a has {lora_a.shape[0]} slots but lora_b has {lora_b.shape[0]}")
    if not 1 <= lora_b.shape[2] <= MAX_RANK:
        raise ValueError(f"r_max = lora_b.shape[2] = {lora_b.shape[2]} must be in [1, {MAX_RANK}]")
    if x.shape[1] != lora_a.shape[2]:
        raise ValueError(f"x has {x.shape[1]} features but lora_a expects in_features={lora_a.shape[2]}")
    expected = (x.shape[0], lora_b.shape[1])
    raise ValueError(f"out must have shape {expected} = (tokens, sum of slice widths), got {tuple(out.shape)}")
