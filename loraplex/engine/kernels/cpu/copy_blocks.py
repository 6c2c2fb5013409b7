"""Many strided fp32 block copies in one C call (copy_blocks.c, see its Semantics): an adapter's slot write."""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from loraplex.engine.kernels.cpu.build import functions

BLOCK_FIELDS = 7  # src, dst, rows, cols, src_ld, dst_ld, scale bits


@functools.cache
def _fns() -> dict | None:
    return functions({"lp_copy_blocks_f32": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64])})


def copy_blocks_available() -> bool:
    return _fns() is not None


def block(src: int, dst: int, rows: int, cols: int, src_ld: int, dst_ld: int, scale: float) -> tuple[int, ...]:
    """One table entry: dst[i, j] = scale * src[i, j] (src = 0: zeros); addresses as integers, lds in floats."""
    (bits,) = struct.unpack("<q", struct.pack("<d", scale))
    return src, dst, rows, cols, src_ld, dst_ld, bits


def copy_blocks(entries: list[tuple[int, ...]]) -> None:
    """Runs the entries (each from block()); their destinations must not overlap. The caller owns the
    addresses: they must lie in live fp32 CPU tensors, which is why this takes no tensors."""
    if not entries:
        return
    table = torch.tensor(entries, dtype=torch.int64)
    if table.shape[1] != BLOCK_FIELDS:
        raise ValueError(f"each entry has {BLOCK_FIELDS} fields, got {table.shape[1]}")
    if _fns()["lp_copy_blocks_f32"](table.data_ptr(), table.shape[0]):
        raise ValueError("a block has negative sizes or a row stride shorter than its row")
