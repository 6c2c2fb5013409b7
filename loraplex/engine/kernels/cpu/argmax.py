"""Row-wise argmax of fp32 logits through argmax.c (see its Semantics): greedy sampling's pick."""

from __future__ import annotations

import ctypes
import functools

import torch

from loraplex.engine.kernels.cpu.build import functions, require


@functools.cache
def _fns() -> dict | None:
    return functions({"lp_argmax_rows_f32": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                            ctypes.c_int64, ctypes.c_void_p])})


def argmax_available() -> bool:
    return _fns() is not None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for x [rows, n] (n >= 1), fp32 on the CPU with dense rows -> int64 [rows]."""
    require("x", x, 2, rows=True)
    if x.shape[1] < 1:
        raise ValueError("argmax over an empty row")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if _fns()["lp_argmax_rows_f32"](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr()):
        raise ValueError(f"rows overlap: row stride {x.stride(0)} is shorter than a row of {x.shape[1]}")
    return out
