"""Many strided fp32 block copies in one C call (copy_blocks.c, see its Semantics): an adapter's slot write."""

from __future__ import annotations

import ctypes
import functools
import struct
from array import array

from loraplex.engine.kernels.cpu.build import functions

BLOCK_FIELDS = 7  # src, dst, rows, cols, src_ld, dst_ld, scale bits


@functools.cache
def _fns() -> dict | None:
    return functions({"lp_copy_blocks_f32": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64])})


def copy_blocks_available() -> bool:
    return _fns() is not None


@functools.lru_cache(maxsize=64)  # a load uses three scales (0, 1, its own)
def _bits(scale: float) -> int:
    return struct.unpack("<q", struct.pack("<d", scale))[0]


def block(src: int, dst: int, rows: int, cols: int, src_ld: int, dst_ld: int, scale: float) -> tuple[int, ...]:
    """One table entry: dst[i, j] = scale * src[i, j] (src = 0: zeros); addresses as integers, lds in floats."""
    return src, dst, rows, cols, src_ld, dst_ld, _bits(scale)


def copy_blocks(entries: list[tuple[int, ...]]) -> None:
    """Runs the entries (each from block()); their destinations must not overlap. The caller owns the
    addresses: they must lie in live fp32 CPU tensors, which is why this takes no tensors."""
    if any(len(e) != BLOCK_FIELDS for e in entries):
        raise ValueError(f"each entry has {BLOCK_FIELDS} fields")
    table = array("q", [v for e in entries for v in e])  # int64, flat
    address, _ = table.buffer_info()
    if entries and _fns()["lp_copy_blocks_f32"](address, len(entries)):
        raise ValueError("a block has negative sizes or a row stride shorter than its row")
