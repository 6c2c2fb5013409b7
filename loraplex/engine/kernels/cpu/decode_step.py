"""A whole decode step in one C call, through decode_step.c (see its Semantics).

The model and LoRA tables (pointers to every weight, KV cache and slot buffer) are built and
checked once; a step then costs one ctypes call and three small allocations, whatever the number
of layers. The tables hold references to their tensors, so the pointers stay valid while a table
lives.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from loraplex.engine.kernels.cpu.build import WEIGHT_CODES, functions, require
from loraplex.engine.kernels.cpu.linear import PackedWeight
from loraplex.engine.kv.kv_dtype import KV_CODES, row_width

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
LORA_MODULES = ("qkv", "o", "gate_up", "down")  # decode_step.c's order
# A layer's weights in the model table, by name (models/llama.py's LayerWeights fields), in decode_step.c's
# order (L_IN_NORM .. L_DOWN); its K and V cache follow (L_K_CACHE, L_V_CACHE), its K smoothing (L_KV_SMOOTH), then
# the projections' element types (L_WTYPE, in LORA_MODULES order).
LAYER_WEIGHTS = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down")
_LORA_WIDTHS = 4
_STEP = struct.Struct("20q")
_ERRORS = {-1: "invalid sizes", -2: "a cache slot, block id, position or row is out of range",
           -3: "out of memory"}


@functools.cache
def _fns() -> dict | None:
    return functions({
        "lp_decode_step_f32": (ctypes.c_int, [_P, _P]),
        "lp_decode_step_scratch_floats": (_I64, [_P, _P, _I64]),
        "lp_lora_fold_floats": (_I64, [_P, _P, _I64, _I64]),
        "lp_lora_fold_pack": (ctypes.c_int, [_P, _P, _I64, _I64, _P, _I64]),
    })


def decode_step_available() -> bool:
    return _fns() is not None


def _ptr(t: torch.Tensor | PackedWeight | None) -> int:
    if t is None:
        return 0
    return (t.data if isinstance(t, PackedWeight) else t).data_ptr()


def _double_bits(v: float) -> int:
    return struct.unpack("q", struct.pack("d", v))[0]


class StepLayer(NamedTuple):
    """One layer of the model table: its weights (any object with the LAYER_WEIGHTS fields: a
    LayerWeights), its K and V cache, each [blocks, block_size, kv_heads, row width] (kv/kv_dtype.py), and
    its K smoothing or None (kv/smoothing.py's layer_table: fp32 [heads * head_dim + 2 * kv_heads * head_dim])."""

    weights: Any
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_smoothing: torch.Tensor | None = None

    def pointers(self) -> list[int]:
        """The layer's entries of the model table, in decode_step.c's order (0 for an absent bias or
        smoothing)."""
        weights = [_ptr(getattr(self.weights, name)) for name in LAYER_WEIGHTS]
        kinds = [getattr(self.weights, name).code for name in LORA_MODULES]
        return weights + [_ptr(self.k_cache), _ptr(self.v_cache), _ptr(self.kv_smoothing)] + kinds


class DecodeStepModel:
    """The model table: dimensions, then per layer (StepLayer.pointers) input norm, qkv, qkv bias or
    None, o, post norm, gate_up, down, K cache, V cache, K smoothing or None, the projections' kinds.
    Projections and the LM head are PackedWeights, each of its own kind (fp32, bf16 or GGUF blocks); caches
    [blocks, block_size, kv_heads, row width] contiguous, all of one kv/kv_dtype.py type (the table's last header
    field, M_KV_TYPE: the step writes and reads that type); rope tables [max_pos, head_dim]."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 rope_cos: torch.Tensor, rope_sin: torch.Tensor, norm: torch.Tensor, lm_head: PackedWeight,
                 layers: Sequence[StepLayer]):
        self._fns = _fns()
        if self._fns is None:
            raise RuntimeError("the CPU kernels are not built (see loraplex.engine.kernels.cpu.build)")
        for name, t in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
            require(name, t, 2)
            if t.shape[1] != head_dim:
                raise ValueError(f"{name} has width {t.shape[1]}, expected head_dim {head_dim}")
        require("norm", norm, 1)
        qkv_out = (heads + 2 * kv_heads) * head_dim
        cache_shape, kv_dtype = tuple(layers[0].k_cache.shape), layers[0].k_cache.dtype
        if kv_dtype not in KV_CODES:
            raise ValueError(f"a KV cache of {kv_dtype} (have: {', '.join(map(str, KV_CODES))})")
        projections = {"qkv": (qkv_out, hidden), "o": (hidden, heads * head_dim),
                       "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}  # [out, in]
        for layer in layers:
            lw = layer.weights
            for name, (n, k) in projections.items():
                w = getattr(lw, name)
                if (w.out_features, w.in_features) != (n, k):
                    raise ValueError(f"{name} is [{w.out_features}, {w.in_features}], expected [{n}, {k}]")
            for name, t, width in (("input norm", lw.input_norm, hidden), ("post norm", lw.post_norm, hidden),
                                   ("qkv bias", lw.qkv_bias, qkv_out)):
                if t is not None:
                    require(name, t, 1)
                    if t.shape[0] != width:
                        raise ValueError(f"{name} has {t.shape[0]} entries, expected {width}")
            if layer.kv_smoothing is not None:
                require("kv_smoothing", layer.kv_smoothing, 1, torch.float32)
                if layer.kv_smoothing.shape[0] != (heads + 2 * kv_heads) * head_dim:
                    raise ValueError(f"kv_smoothing has {layer.kv_smoothing.shape[0]} entries, expected "
                                     f"{(heads + 2 * kv_heads) * head_dim}")
            for name, t in (("k_cache", layer.k_cache), ("v_cache", layer.v_cache)):
                require(name, t, 4, kv_dtype)
                if tuple(t.shape) != cache_shape or t.shape[2:] != (kv_heads, row_width(head_dim, kv_dtype)):
                    raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {cache_shape}")
        if lm_head.in_features != hidden or norm.shape[0] != hidden:
            raise ValueError("the LM head and final norm must take the hidden size")
        self.hidden, self.vocab = hidden, lm_head.out_features
        self._keep = (rope_cos, rope_sin, norm, lm_head, list(layers))
        fields = [len(layers), hidden, heads, kv_heads, head_dim, intermediate, lm_head.out_features,
                  cache_shape[1], cache_shape[0] * cache_shape[1], _double_bits(eps), _ptr(rope_cos),
                  _ptr(rope_sin), rope_cos.shape[0], _ptr(norm), _ptr(lm_head), lm_head.code,
                  KV_CODES[kv_dtype]]
        for layer in layers:
            fields += layer.pointers()
        self.table = torch.tensor(fields, dtype=torch.int64)
        self._scale_bits = _double_bits(1.0 / head_dim ** 0.5)  # the attention scale, as the step block holds it
        self.lora_dims = (len(layers), (hidden, qkv_out), (heads * head_dim, hidden), (hidden, 2 * intermediate),
                          (intermediate, hidden))  # layers, then (in, out) of qkv, o, gate_up, down

    def run(self, h: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor, logits_rows: torch.Tensor, lora: DecodeStepLora | None = None,
            lora_groups=None, lora_fold: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step for B sequences: h [B, hidden] (the embedded tokens; the residual stream is
        updated in place), positions, slot_mapping, lens [B] int64, tables [B, max_blocks] int64,
        logits_rows [n] int64. With `lora` (a DecodeStepLora) and `lora_groups` (the step's
        LoraBatchIndex.slot_groups), adapter deltas are added; with `lora_fold` (slot, that slot's
        DecodeStepLora.pack_fold block) that adapter's deltas are folded into the GEMMs. Returns logits
        [n, vocab] fp32."""
        require("h", h, 2)
        b = h.shape[0]
        if h.shape[1] != self.hidden:
            raise ValueError(f"h has width {h.shape[1]}, expected hidden size {self.hidden}")
        for name, t in (("positions", positions), ("slot_mapping", slot_mapping), ("lens", lens)):
            require(name, t, 1, torch.int64)
            if t.shape[0] != b:
                raise ValueError(f"{name} has {t.shape[0]} entries for {b} sequences")
        require("tables", tables, 2, torch.int64)
        require("logits_rows", logits_rows, 1, torch.int64)
        if tables.shape[0] != b:
            raise ValueError(f"tables has {tables.shape[0]} rows for {b} sequences")
        scratch = torch.empty(self._fns["lp_decode_step_scratch_floats"](
            self.table.data_ptr(), lora.table.data_ptr() if lora is not None else None, b), dtype=torch.float32)
        logits = torch.empty(logits_rows.shape[0], self.vocab, dtype=torch.float32)
        lora_fields = (0, 0, 0, 0, 0, 0, 0, 0)
        if lora is not None:  # (lora.c checks the groups against the batch and the slots)
            if lora.dims != self.lora_dims:
                raise ValueError(f"the LoRA table's (in, out) per module {lora.dims} do not fit the model's "
                                 f"{self.lora_dims}")
            fold_slot, fold = lora_fold if lora_fold is not None else (-1, None)
            lora_fields = (lora.table.data_ptr(), lora_groups.rows.data_ptr(), lora_groups.num_rows,
                           lora_groups.groups.data_ptr(), lora_groups.num_groups, fold_slot,
                           0 if fold is None else fold.data_ptr(), 0 if fold is None else fold.numel())
        step = _STEP.pack(b, h.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(), tables.data_ptr(),
                          tables.shape[1], lens.data_ptr(), self._scale_bits, scratch.data_ptr(),
                          logits_rows.shape[0], logits_rows.data_ptr(), logits.data_ptr(), *lora_fields)
        rc = self._fns["lp_decode_step_f32"](self.table.data_ptr(), step)
        if rc:
            raise ValueError(f"lp_decode_step_f32 refused the step: {_ERRORS.get(rc, rc)}")
        return logits


class DecodeStepLora:
    """The LoRA table: slot count, r_max, ranks [slots] int32, the buffers' element type, each fused
    module's slice widths, then per layer and module the stacked A [slots, S * r_max, in] (contiguous)
    and B [slots, out, r_max] (rank-major) buffers (lora_ops' layout), all fp32, bf16 or fp16 (one
    dtype: lora.c widens 16-bit weights as it loads them)."""

    def __init__(self, lora_a: Sequence[dict[str, torch.Tensor]], lora_b: Sequence[dict[str, torch.Tensor]],
                 ranks: torch.Tensor, slice_widths: dict[str, tuple[int, ...]]):
        require("ranks", ranks, 1, torch.int32)
        num_slots = ranks.shape[0]
        r_max = lora_b[0][LORA_MODULES[0]].shape[2]
        dtype = lora_a[0][LORA_MODULES[0]].dtype
        if dtype not in WEIGHT_CODES:
            raise ValueError(f"the slot buffers must be float32, bfloat16 or float16, got {dtype}")
        fields = [num_slots, r_max, ranks.data_ptr(), WEIGHT_CODES[dtype]]
        for m in LORA_MODULES:
            widths = tuple(slice_widths[m])
            if not 1 <= len(widths) <= _LORA_WIDTHS:
                raise ValueError(f"{m}: 1 to {_LORA_WIDTHS} slices, got {widths}")
            fields += [len(widths), *widths, *[0] * (_LORA_WIDTHS - len(widths))]
        for a_layer, b_layer in zip(lora_a, lora_b, strict=True):
            for m in LORA_MODULES:
                a, bm = a_layer[m], b_layer[m]
                require(f"{m} A", a, 3, dtype)
                require(f"{m} B (rank-major, its storage)", bm.transpose(1, 2), 3, dtype)
                if a.shape[2] != lora_a[0][m].shape[2]:
                    raise ValueError(f"{m}: A takes {a.shape[2]} features in one layer, "
                                     f"{lora_a[0][m].shape[2]} in another")
                if (a.shape[0], bm.shape[0]) != (num_slots, num_slots) or bm.shape[2] != r_max \
                        or a.shape[1] != len(slice_widths[m]) * r_max or bm.shape[1] != sum(slice_widths[m]):
                    raise ValueError(f"{m}: A {tuple(a.shape)} and B {tuple(bm.shape)} do not match "
                                     f"{num_slots} slots of rank {r_max} and widths {slice_widths[m]}")
                fields += [a.data_ptr(), bm.data_ptr()]
        self._keep = (list(lora_a), list(lora_b), ranks)
        self.dims = (len(lora_a), *((lora_a[0][m].shape[2], lora_b[0][m].shape[1]) for m in LORA_MODULES))
        self.table = torch.tensor(fields, dtype=torch.int64)
        self._ranks = ranks
        self._ins = torch.tensor([lora_a[0][m].shape[2] for m in LORA_MODULES], dtype=torch.int64)
        self._fns = _fns()

    def pack_fold(self, slot: int) -> torch.Tensor:
        """The adapter in `slot` packed for folding into the step's GEMMs (lora_fold.c's layout), from
        the slot buffers as they are now: pack again after the slot is rewritten."""
        if not 0 <= slot < self._ranks.shape[0] or int(self._ranks[slot]) < 1:
            raise ValueError(f"slot {slot} holds no adapter")
        rank = min(int(self._ranks[slot]), int(self.table[1]))
        floats = self._fns["lp_lora_fold_floats"](self.table.data_ptr(), self._ins.data_ptr(), self.dims[0], rank)
        out = torch.empty(floats, dtype=torch.float32)
        if self._fns["lp_lora_fold_pack"](self.table.data_ptr(), self._ins.data_ptr(), self.dims[0], slot,
                                          out.data_ptr(), floats):
            raise ValueError(f"lp_lora_fold_pack refused slot {slot}")
        return out
