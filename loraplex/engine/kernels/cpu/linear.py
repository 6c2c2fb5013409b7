"""Linear layers over packed weights on the CPU, through linear.c (see its Semantics): fp32 panels, bf16
ones (linear_bf16.c) widened as they are loaded, or GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K blocks
(linear_q*.c, quant_blocks.h) dequantized in registers, with fp32 activations and sums; or, for blocks packed
with act8 (EngineConfig.activation_dtype int8), over activations quantized to int8 per 32 k (linear_act8.h: exact
integer sums, vpdpbusd with VNNI)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass

import torch

from loraplex.engine.kernels.cpu.build import functions, require
from loraplex.engine.quant import BLOCK_BYTES, BLOCK_WEIGHTS, BlockWeight, dequantize

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Fold(ctypes.Structure):
    """kernels.h's lp_fold_t."""
    _fields_ = [("ap", _P), ("bp", _P), ("pa", _I64), ("rank", _I64), ("S", _I64), ("widths", _P), ("y", _P),
                ("keep", _P)]


# The packed panels' element types and their kernels' suffix (linear.c, linear_bf16.c)
PACKED_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# GGUF block formats with kernels (linear_q*.c): their suffix is the format's name (quant.BLOCK_BYTES)
BLOCK_KINDS = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")
# Each kind's code in the fused decode step's model table (lora_weights.h, LP_W_*)
KIND_CODES = {"f32": 0, "bf16": 1, "q8_0": 3, "q4_0": 4, "q4_1": 5, "q4_k": 6, "q5_k": 7, "q6_k": 8}
# Block formats with an int8-activation build (linear_act8.h: all), and the flag their code carries then (LP_W_ACT8)
ACT8_KINDS = BLOCK_KINDS
ACT8_FLAG = 16


@functools.cache
def _fns() -> dict | None:
    per_type = {}
    for t in PACKED_DTYPES.values():
        per_type[f"lp_pack_{t}"] = (None, [_P, _I64, _I64, _P])
    for t in BLOCK_KINDS:
        per_type |= {f"lp_pack_{t}": (ctypes.c_int, [_P, _I64, _I64, _P]), f"lp_packed_bytes_{t}": (_I64, [_I64, _I64]),
                     f"lp_unpack_rows_{t}": (ctypes.c_int, [_P, _I64, _I64, _P, _I64, _P])}
    for t in (*PACKED_DTYPES.values(), *BLOCK_KINDS, *(f"a8_{k}" for k in ACT8_KINDS)):
        per_type |= {
            f"lp_linear_packed_{t}": (ctypes.c_int, [_P, _I64, _I64, _I64, _P, _I64, _P, _P]),
            f"lp_linear_fold_{t}": (ctypes.c_int, [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P,
                                                   ctypes.POINTER(_Fold)]),
        }
    return functions({
        "lp_panel_columns": (_I64, []),
        "lp_fold_shrink_width": (_I64, [_I64, _I64]),
        "lp_packed_size": (_I64, [_I64, _I64]),
        "lp_fold_module_floats": (_I64, [_I64, _I64, _I64, _P, _I64]),
        **per_type,
    })


def linear_available() -> bool:
    return _fns() is not None


@functools.cache
def panel_columns() -> int:
    """Output columns per packed panel in this build of linear.c: three vectors, 48 with AVX-512, 24
    with AVX2 or none."""
    return _fns()["lp_panel_columns"]()


# Batches above packed_max_rows() rows go to MKL over the unpacked weight. With AVX2 (24-column
# panels) the packed kernel was 1.1-1.8x MKL's F.linear up to 256 rows on the model's shapes (1 and 2
# threads, cold weights) and about even at 384-512, where MKL's own cache blocking catches up. With
# AVX-512 (48-column panels) it was 1.05-1.5x MKL from 256 to 2048 rows (bench/RESULTS.md's git history), so it
# serves every batch.
AVX2_PACKED_MAX_ROWS = 256
PACKED_MAX_ROWS: int | None = None  # None: by the build, as above (tests set it to force a path)


def packed_max_rows() -> int:
    if PACKED_MAX_ROWS is not None:
        return PACKED_MAX_ROWS
    return AVX2_PACKED_MAX_ROWS if panel_columns() < 48 else 1 << 62


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out_features, in_features] in linear.c's panel layout (flat storage: fp32, bf16, or the bytes
    of a GGUF block format; `kind` names it as the kernels' suffix does), with the weight itself (the loaded
    tensor, no copy) for prefill-sized batches on builds where MKL serves those; `weight` is None for a copy
    made only for decode steps (an adapter merged into the weights, lora/merged.py) and for blocks (the
    packed kernel serves every batch: a float copy would cost what quantizing saved)."""

    data: torch.Tensor
    weight: torch.Tensor | None
    out_features: int
    in_features: int
    kind: str = "f32"  # "f32", "bf16" (PACKED_DTYPES) or a BLOCK_KINDS format
    act8: bool = False  # GEMMs over it quantize the activations to int8 (an ACT8_KINDS format; linear_act8.h)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def suffix(self) -> str:
        """Its kernels' suffix: the kind, a8_<kind> with act8."""
        return f"a8_{self.kind}" if self.act8 else self.kind

    @property
    def code(self) -> int:
        """Its code in the fused decode step's model table (KIND_CODES, plus ACT8_FLAG with act8)."""
        return KIND_CODES[self.kind] | (ACT8_FLAG if self.act8 else 0)


def pack(w: torch.Tensor, keep_weight: bool = True, dtype: torch.dtype = torch.float32) -> PackedWeight:
    """Packs a weight [out, in] (fp32, CPU) once, at model load, into panels of `dtype` (float32, or
    bfloat16: each weight rounded to nearest even, as torch's .to() rounds); keep_weight=False drops
    the reference to `w` (the packed copy then serves packed_max_rows() rows at most)."""
    fns = _fns()
    require("w", w, 2)
    if dtype not in PACKED_DTYPES:
        raise ValueError(f"packed weights are float32 or bfloat16, got {dtype}")
    n, k = w.shape
    data = torch.empty(fns["lp_packed_size"](n, k), dtype=dtype)
    fns[f"lp_pack_{PACKED_DTYPES[dtype]}"](w.data_ptr(), n, k, data.data_ptr())
    return PackedWeight(data, w if keep_weight else None, n, k, PACKED_DTYPES[dtype])


def pack_blocks(w: BlockWeight) -> PackedWeight:
    """Packs GGUF blocks [out, in] once, at model load, into the panels of their format (quant_blocks.h);
    ValueError naming the format when no kernel takes it (with_act8: the same panels over int8 activations)."""
    if w.fmt not in BLOCK_KINDS:
        raise ValueError(f"no CPU kernel takes {w.fmt} blocks (these do: {', '.join(BLOCK_KINDS)})")
    fns = _fns()
    blocks = w.data  # (held here: PanelBlocks makes a fresh tensor on each access)
    require("blocks", blocks, 2, torch.uint8)
    n, k = w.shape
    data = torch.empty(fns[f"lp_packed_bytes_{w.fmt}"](n, k), dtype=torch.uint8)
    if fns[f"lp_pack_{w.fmt}"](blocks.data_ptr(), n, k, data.data_ptr()):
        raise ValueError(f"{w.fmt} weight [{n}, {k}]: in_features must be a multiple of {BLOCK_WEIGHTS[w.fmt]}")
    return PackedWeight(data, None, n, k, w.fmt)


def with_act8(w: PackedWeight, act8: bool = True) -> PackedWeight:
    """The same panels (no copy) for GEMMs over int8 (act8) or fp32 activations."""
    if act8 and w.kind not in ACT8_KINDS:
        raise ValueError(f"no int8-activation kernel takes {w.kind} weights (these do: {', '.join(ACT8_KINDS)})")
    return dataclasses.replace(w, act8=act8)


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for x [tokens, in] (rows may be strided, features dense) -> [tokens, out]."""
    if x.dim() == 2 and x.shape[0] > packed_max_rows() and w.weight is not None:
        return torch.nn.functional.linear(x, w.weight, bias)
    fns = _fns()
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a 2-d float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.shape[1] != w.in_features:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {w.in_features}")
    if bias is not None:
        require("bias", bias, 1)
        if bias.shape[0] != w.out_features:
            raise ValueError(f"bias has {bias.shape[0]} entries for {w.out_features} outputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    rc = fns[f"lp_linear_packed_{w.suffix}"](
        x.data_ptr(), x.shape[0], max(x.stride(0), w.in_features), w.in_features, w.data.data_ptr(), w.out_features,
        None if bias is None else bias.data_ptr(), y.data_ptr())
    if rc:
        raise MemoryError(f"lp_linear_packed_{w.suffix} failed ({rc}): no memory for its int8 activations")
    return y


def fold_shrink_panels(slices: int, rank: int) -> tuple[int, int]:
    """A fold's shrink panels over `slices` slices of `rank` rows (kernels.h, lp_fold_width and
    lp_fold_panels): (columns per panel, panels). Whole vectors of a third of a GEMM panel, at most a
    GEMM panel."""
    width = _fns()["lp_fold_shrink_width"](slices, rank)
    return width, -(-slices * rank // width)


def fold_module_floats(in_features: int, widths: tuple[int, ...], rank: int) -> int:
    """Floats of one module's block in a fold (lora_fold.c's layout) for an adapter of this rank."""
    w = torch.tensor(widths, dtype=torch.int64)
    return _fns()["lp_fold_module_floats"](in_features, sum(widths), len(widths), w.data_ptr(), rank)


def packed_linear_fold(x: torch.Tensor, w: PackedWeight, block: torch.Tensor, widths: tuple[int, ...], rank: int,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T plus, in the rows `keep` marks (uint8 [tokens], None = all), the delta of an adapter
    folded in: `block` is one module's fold block (lora_fold.c's layout, fold_module_floats floats) of
    an adapter of `rank` over slices of these output widths. linear.c's fold, as the fused decode step
    runs it; x [tokens, in] fp32 contiguous."""
    require("x", x, 2)
    require("block", block, 1)
    t, k = x.shape
    if k != w.in_features or sum(widths) != w.out_features or rank < 1:
        raise ValueError(f"x [{t}, {k}], widths {widths} and rank {rank} do not fit the weight "
                         f"[{w.out_features}, {w.in_features}]")
    if block.numel() != fold_module_floats(k, widths, rank):
        raise ValueError(f"the fold block has {block.numel()} floats, expected {fold_module_floats(k, widths, rank)}")
    if keep is not None:
        require("keep", keep, 1, torch.uint8)
        if keep.shape[0] != t:
            raise ValueError(f"keep has {keep.shape[0]} entries for {t} rows")
    aw, pa = fold_shrink_panels(len(widths), rank)
    wt = torch.tensor(widths, dtype=torch.int64)
    y_scratch = torch.empty(t, pa * aw, dtype=torch.float32)
    fold = _Fold(block.data_ptr(), block.data_ptr() + pa * k * aw * 4, pa, rank, len(widths), wt.data_ptr(),
                 y_scratch.data_ptr(), None if keep is None else keep.data_ptr())
    y = torch.empty(t, w.out_features, dtype=torch.float32)
    name = f"lp_linear_fold_{w.suffix}"
    rc = _fns()[name](x.data_ptr(), t, k, k, w.data.data_ptr(), w.out_features, None, y.data_ptr(), None,
                      ctypes.byref(fold))
    if rc:
        raise ValueError(f"{name} refused the call: invalid sizes")
    return y


def unpack_rows(w: PackedWeight, index: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `index` [n] (None: all) of a block weight as GGUF rows (uint8 [n, in / block weights * block
    bytes]) from its panels: the inverse of pack_blocks (lp_unpack_rows_<fmt>), reading only those rows' panels."""
    n, k = w.out_features, w.in_features
    rows = torch.arange(n) if index is None else index.to(device="cpu", dtype=torch.int64).contiguous()
    out = torch.empty(rows.shape[0], k // BLOCK_WEIGHTS[w.kind] * BLOCK_BYTES[w.kind], dtype=torch.uint8)
    if _fns()[f"lp_unpack_rows_{w.kind}"](w.data.data_ptr(), n, k, rows.data_ptr(), rows.shape[0], out.data_ptr()):
        raise IndexError(f"rows out of range for a {w.kind} weight of {n} rows")
    return out


def panel_rows(w: PackedWeight, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [n] of a block weight, dequantized from its panels to fp32 [n, in] exactly as
    quant.dequantize does (an embedding lookup that needs no other copy of the table; only the rows' own
    panels are read)."""
    return dequantize(BlockWeight(w.kind, unpack_rows(w, index)))


class PanelBlocks(BlockWeight):
    """A block weight whose only copy is its packed panels: CpuKernelOps.prepare takes the panels as they are,
    embedding rows come from them (panel_rows), and the GGUF rows (merges, another device) are unpacked
    when asked for. So a resident model holds its blocks once."""

    def __init__(self, packed: PackedWeight):
        if packed.kind not in BLOCK_KINDS:
            raise ValueError(f"PanelBlocks holds GGUF block panels, not {packed.kind}")
        object.__setattr__(self, "packed", packed)
        object.__setattr__(self, "fmt", packed.kind)

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"PanelBlocks({self.fmt}, [{self.packed.out_features}, {self.packed.in_features}])"

    @property
    def data(self) -> torch.Tensor:  # (unpacked on each call: merges and moves are rare)
        return unpack_rows(self.packed)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.out_features, self.packed.in_features))

    @property
    def device(self) -> torch.device:
        return self.packed.data.device

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def to(self, device=None, dtype=None) -> BlockWeight:
        if device is None or torch.device(device).type == "cpu":
            return self
        return BlockWeight(self.fmt, self.data).to(device)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return panel_rows(self.packed, index)
