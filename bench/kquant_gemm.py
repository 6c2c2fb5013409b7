"""Side by side on the CPU: linear.c's packed GEMM over GGUF blocks vs the same values dequantized to fp32 and
bf16 panels, at decode batches of 1 and 8 rows (random valid blocks; the best of 7 timings of 20 calls each).

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/kquant_gemm.py [q4_k,q5_k,q6_k,q4_1,q8_0]
"""

from __future__ import annotations

import os
import sys
import time

import torch

from loraplex.engine.kernels.cpu import linear
from loraplex.engine.kernels.cpu.linear import pack, pack_blocks, packed_linear
from loraplex.engine.quant import BLOCK_BYTES, BLOCK_WEIGHTS, BlockWeight, dequantize

HALVES = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632)]  # [out, in]: TinyLlama-1.1B's o, gate / up, down


def random_blocks(fmt: str, n: int, k: int) -> BlockWeight:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, k // BLOCK_WEIGHTS[fmt], BLOCK_BYTES[fmt]), dtype=torch.uint8, generator=g)
    std = 2e-4 if fmt.endswith("_k") else 2e-3
    halves = (torch.randn(*raw.shape[:2], 2, generator=g) * std).half().view(torch.uint8)
    for i, at in enumerate(HALVES[fmt]):
        raw[..., at:at + 2] = halves[..., 2 * i:2 * i + 2]
    return BlockWeight(fmt, raw.reshape(n, -1))


def best_seconds(fn, iters: int = 20, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t) / iters)
    return min(times)


def main(fmts: list[str]) -> None:
    linear.PACKED_MAX_ROWS = 10**6  # (every batch through the packed kernel)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for fmt in fmts:
        for n, k in SHAPES:
            w = random_blocks(fmt, n, k)
            values = dequantize(w)
            panels = {fmt: pack_blocks(w), "f32": pack(values, keep_weight=False),
                      "bf16": pack(values, keep_weight=False, dtype=torch.bfloat16)}
            for m in (1, 8):
                x = torch.randn(m, k)
                t = {name: best_seconds(lambda p=p, x=x: packed_linear(x, p)) for name, p in panels.items()}
                print(f"{fmt} [{n}, {k}] M={m}: {t[fmt] * 1e3:.3f} ms ({panels[fmt].nbytes * 8 / n / k:.3f} bits/w), "
                      f"f32 {t['f32'] * 1e3:.3f}, bf16 {t['bf16'] * 1e3:.3f}; "
                      f"f32/{fmt} {t['f32'] / t[fmt]:.2f}x, bf16/{fmt} {t['bf16'] / t[fmt]:.2f}x", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["q4_k", "q5_k", "q6_k"])
