"""Many strided block copies from fp32 into fp32, bf16 or fp16 in one C call (copy_blocks.c, see its
Semantics): an adapter's slot write."""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from loraplex.engine.kernels.cpu.build import WEIGHT_CODES, functions

BLOCK_FIELDS = 8  # src, dst, rows, cols, src_ld, dst_ld, scale bits, src column stride


@functools.cache
def _fns() -> dict | None:
    return functions({"lp_copy_blocks_to": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64])})


def copy_blocks_available() -> bool:
    return _fns() is not None


def scale_bits(scale: float) -> int:
    """A scale as the table holds it: the double's bits as an int64."""
    return struct.unpack("<q", struct.pack("<d", scale))[0]


def scale_bits_column(scales: torch.Tensor) -> torch.Tensor:
    """scale_bits of every value of a float64 tensor at once (a table's whole scale column)."""
    return scales.to(torch.float64).contiguous().view(torch.int64)


def block(src: int, dst: int, rows: int, cols: int, src_ld: int, dst_ld: int, scale: float,
          src_cs: int = 1) -> tuple[int, ...]:
    """One table row: dst[i * dst_ld + j] = scale * src[i * src_ld + j * src_cs] (src = 0: zeros); addresses as
    integers, strides in elements (src_ld 1 and src_cs > 1 read src transposed)."""
    return src, dst, rows, cols, src_ld, dst_ld, scale_bits(scale), src_cs


def copy_blocks(table: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """Runs the table: int64 [blocks, BLOCK_FIELDS] on the CPU, rows as block() makes them (or built as
    columns); their destinations must not overlap. The caller owns the addresses: the sources must lie in
    live fp32 CPU tensors and the destinations in live CPU tensors of `dtype` (fp32, bf16 or fp16: the
    products are rounded to it), which is why the table holds integers, not tensors."""
    if dtype not in WEIGHT_CODES:
        raise ValueError(f"the destination dtype must be float32, bfloat16 or float16, got {dtype}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != BLOCK_FIELDS or table.device.type != "cpu":
        raise ValueError(f"the table must be an int64 CPU tensor [blocks, {BLOCK_FIELDS}], got {table.dtype} "
                         f"{tuple(table.shape)} on {table.device}")
    table = table.contiguous()
    if table.shape[0] and _fns()["lp_copy_blocks_to"](table.data_ptr(), table.shape[0], WEIGHT_CODES[dtype]):
        raise ValueError("a block has negative sizes, a column stride below 1 or a row stride shorter than its row")
