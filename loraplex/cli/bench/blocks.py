"""The CPU's packed GEMM over GGUF blocks against the same values in fp32 and bf16 panels, in one run.

- Random valid blocks of each format (fp16 scales of a weight's size), at the [out, in] shapes of a 1B
  model's projections (TinyLlama-1.1B: o, gate / up, down) and at decode batches of a few rows.
- Each format's panels, the fp32 panels and the bf16 panels of the same dequantized values take turns per
  repeat; each one's best repeat counts (a shared machine's noise only slows). Ratios above 1: the blocks
  are faster.
- Each format also over int8 activations (`int8_act`: the same panels, linear_act8.h), against the
  float-activation blocks (int8_act_over_blocks) and the fp32 panels (int8_act_over_fp32).
"""

from __future__ import annotations

import platform
import time

import torch

from loraplex.engine.kernels.cpu import build, linear
from loraplex.engine.quant import BLOCK_BYTES, BLOCK_WEIGHTS, BlockWeight, dequantize

# Where each format's fp16 scale (and min) lie in a block (random bytes there would be huge)
SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
SHAPES = ((2048, 2048), (5632, 2048), (2048, 5632))  # [out, in]
MAX_ROWS = 64


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> BlockWeight:
    """Blocks of random integers (and K-quant sub-block scales) with finite random fp16 scales (and mins); the
    K-quants' smaller, as their scales are multiplied by sub-block integers up to 63 (a model's weights stay
    near 0.02). Also the kernel tests' weights."""
    g = torch.Generator().manual_seed(seed)
    blocks = cols // BLOCK_WEIGHTS[fmt]
    raw = torch.randint(0, 256, (rows, blocks, BLOCK_BYTES[fmt]), dtype=torch.uint8, generator=g)
    std = 0.0002 if fmt.endswith("_k") else 0.02
    scales = (torch.randn(rows, blocks, 2, generator=g) * std).half().view(torch.uint8)  # [rows, blocks, 4]
    for i, at in enumerate(SCALE_OFFSETS[fmt]):
        raw[..., at:at + 2] = scales[..., 2 * i:2 * i + 2]
    return BlockWeight(fmt, raw.reshape(rows, -1))


def _parse(formats: str, rows: str) -> tuple[list[str], list[int]]:
    names = [f for f in formats.split(",") if f]
    if not names or any(f not in SCALE_OFFSETS for f in names):
        raise ValueError(f"--formats: any of {', '.join(SCALE_OFFSETS)}, comma-separated, got {formats!r}")
    try:
        sizes = [int(r) for r in rows.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(not 1 <= r <= MAX_ROWS for r in sizes):
        raise ValueError(f"--rows: row counts from 1 to {MAX_ROWS}, comma-separated, got {rows!r}")
    return names, sizes


def _timed(fn, calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls


def run_blocks_bench(formats: str, rows: str, repeats: int, calls: int, shapes: str = "full") -> dict:
    names, sizes = _parse(formats, rows)
    if repeats < 1 or calls < 1:
        raise ValueError(f"--repeats and --calls must be at least 1, got {repeats} and {calls}")
    if not linear.linear_available():
        raise ValueError("the CPU kernels are not built here (`loraplex doctor` says why)")
    linear.PACKED_MAX_ROWS = 10**6  # every row count through the packed kernel, not torch's GEMM
    chosen = SHAPES if shapes == "full" else ((256, 512),)
    machine = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "instruction_sets": list(build.build_instruction_sets() or ())}
    results: dict = {"machine": machine, "repeats": repeats, "calls": calls, "results": []}
    for fmt in names:
        for n, k in chosen:
            w = random_blocks(fmt, n, k)
            values = dequantize(w)  # [n, k] fp32, gguf's own values
            panels = {fmt: linear.pack_blocks(w), "fp32": linear.pack(values, keep_weight=False),
                      "bf16": linear.pack(values, keep_weight=False, dtype=torch.bfloat16)}
            panels["int8_act"] = linear.with_act8(panels[fmt])
            for m in sizes:
                x = torch.randn(m, k)
                best = dict.fromkeys(panels, float("inf"))
                for _ in range(repeats):  # the three take turns
                    for name, p in panels.items():
                        linear.packed_linear(x, p)  # warm
                        best[name] = min(best[name], _timed(lambda p=p, x=x: linear.packed_linear(x, p), calls))
                results["results"].append({
                    "format": fmt, "shape": [n, k], "rows": m,
                    "bits_per_weight": round(panels[fmt].nbytes * 8 / (n * k), 3),
                    "ms": {name: round(t * 1e3, 4) for name, t in best.items()},
                    "fp32_over_blocks": round(best["fp32"] / best[fmt], 3),
                    "bf16_over_blocks": round(best["bf16"] / best[fmt], 3),
                    "int8_act_over_blocks": round(best[fmt] / best["int8_act"], 3),
                    "int8_act_over_fp32": round(best["fp32"] / best["int8_act"], 3)})
    return results
