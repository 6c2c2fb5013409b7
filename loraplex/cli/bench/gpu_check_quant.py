"""gpu-check's quant step (3): int8 (W8A16 Triton kernel) and FP8 (torch._scaled_mm) weight GEMMs on the device,
each against its reference (kernels/quant_ref.py, max error) and timed against a bf16 F.linear over the same
weight.

Full run on CUDA: a decode-sized weight (4096 x 4096) at M = 1, 16 and 256 tokens, bf16 activations;
`speedup_vs_bf16` = bf16 time / quantized time (> 1: faster), each call replayed from a CUDA graph
(`eager_*`: launched from Python). FP8 is skipped, the reason in the summary,
where kernels.fp8_linear.fp8_unsupported gives one (not CUDA, or compute capability < 8.9). --quick or the CPU:
a 96 x 64 weight at M = 1 and 3, Triton in its interpreter (times say nothing about a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loraplex.cli.bench import roofline
from loraplex.engine.kernels.fp8_linear import fp8_unsupported
from loraplex.engine.kernels.lora_ops import triton_available
from loraplex.engine.kernels.quant_linear import QuantizedLinearWeight, linear, quantize
from loraplex.engine.kernels.quant_ref import ref_fp8_linear, ref_w8a16_linear

if TYPE_CHECKING:
    from loraplex.cli.bench.gpu_check import CheckContext

Outcome = tuple[str, str, dict]
DTYPE = torch.bfloat16
FULL_SHAPE, QUICK_SHAPE = (4096, 4096), (96, 64)  # (out, in)
FULL_M, QUICK_M = (1, 16, 256), (1, 3)
# Largest |quantized path - reference| over the reference's largest |value|: bf16 output rounding and
# summation order for int8; FP8 also rounds inside torch._scaled_mm, which the reference does not model.
MAX_REL_ERR = {"int8": 1e-2, "fp8": 2e-2}


def _ratio(a: float, b: float) -> float:
    """a / b to 4 significant digits (the interpreter's ratios on the CPU can be far below 0.001)."""
    return float(f"{a / b:.4g}")


def path_name(kind: str, device: torch.device) -> str:
    """Which implementation `linear` takes for this kind on this device."""
    if kind == "fp8":
        return "torch._scaled_mm"
    if device.type == "cuda":
        return "triton"
    return "triton-interpreter" if triton_available(device) else "torch-dequantize"


def reference(kind: str, x: torch.Tensor, qw: QuantizedLinearWeight) -> torch.Tensor:
    if kind == "int8":
        return ref_w8a16_linear(x, qw.data, qw.scales)
    return ref_fp8_linear(x, qw.data, qw.scales, act_scale=qw.act_scale)


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """fn captured once in a CUDA graph (the way decode runs with cuda_graphs on): replays time the kernels,
    not Python's launch cost, which at M = 1 exceeds a 4096 x 4096 GEMM's."""
    fn()  # warm-up, off the capture: compiles the Triton kernel, initialises cuBLAS, picks _scaled_mm's scaling
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device), torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_pair(quantized: Callable[[], object], bf16: Callable[[], object], ctx: CheckContext) -> dict:
    """Microseconds per call of each (best of repeats, the device synchronised) and bf16 / quantized; on CUDA
    per replay of a captured call, and eager as well."""
    repeats, iters = (1, 1) if not ctx.cuda else (5, 50)
    q = roofline.best_seconds(quantized, repeats, ctx.device, iters)
    b = roofline.best_seconds(bf16, repeats, ctx.device, iters)
    out = {"us": round(q * 1e6, 2), "bf16_us": round(b * 1e6, 2), "speedup_vs_bf16": _ratio(b, q)}
    if not ctx.cuda:
        return out
    out.update(eager_us=out["us"], eager_bf16_us=out["bf16_us"], eager_speedup_vs_bf16=out["speedup_vs_bf16"])
    try:
        q = roofline.best_seconds(graphed(quantized, ctx.device), repeats, ctx.device, iters)
        b = roofline.best_seconds(graphed(bf16, ctx.device), repeats, ctx.device, iters)
    except RuntimeError as e:  # a capture that fails: the eager figures stand, and why
        out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        return out
    out.update(us=round(q * 1e6, 2), bf16_us=round(b * 1e6, 2), speedup_vs_bf16=_ratio(b, q))
    return out


def one_kind(ctx: CheckContext, kind: str, w: torch.Tensor, ms: tuple[int, ...]) -> dict:
    """Max error against the reference and times against bf16 F.linear at each token count."""
    qw = quantize(w, kind, name=f"gpu_check.{kind}")
    w16 = w.to(DTYPE)
    out = {"path": path_name(kind, ctx.device), "weight_bytes": qw.nbytes, "bf16_weight_bytes": w16.numel() * 2,
           "weight_max_abs_err": round(float((qw.dequantize() - w.float()).abs().max()), 6)}
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    worst = 0.0
    for m in ms:
        x = torch.randn(m, w.shape[1], generator=gen, device=ctx.device).to(DTYPE)
        got, want = linear(x, qw).float().cpu(), reference(kind, x, qw)
        err = float((got - want).abs().max())
        rel = err / max(float(want.abs().max()), 1e-12)
        worst = max(worst, rel)
        out[f"m{m}"] = {"max_abs_err": round(err, 6), "rel_err": round(rel, 6),
                        **time_pair(lambda x=x: linear(x, qw), lambda x=x: F.linear(x, w16), ctx)}
    out["worst_rel_err"] = round(worst, 6)
    out["ok"] = worst <= MAX_REL_ERR[kind]
    return out


def quant(ctx: CheckContext) -> Outcome:
    """int8 and FP8 weight GEMMs vs reference and vs bf16 F.linear; FP8 skipped (with why) below sm89."""
    n, k = QUICK_SHAPE if ctx.quick or not ctx.cuda else FULL_SHAPE
    ms = QUICK_M if ctx.quick or not ctx.cuda else FULL_M
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    w = torch.randn(n, k, generator=gen, device=ctx.device) / k ** 0.5  # fp32 [out, in]
    figures: dict = {"weight": [n, k], "activations": roofline.dtype_name(DTYPE), "tokens": list(ms),
                     "max_rel_err": MAX_REL_ERR}
    if not ctx.cuda:
        figures["note"] = "cpu: Triton in the interpreter on a tiny weight; the times say nothing about a GPU"
    notes, problems = [], []
    why_not = {"int8": None, "fp8": fp8_unsupported(ctx.device)}
    for kind in ("int8", "fp8"):
        if why_not[kind]:
            figures[kind] = {"skipped": why_not[kind]}
            notes.append(f"{kind} skipped: {why_not[kind]}")
            continue
        f = figures[kind] = one_kind(ctx, kind, w, ms)
        ratios = ", ".join(f"M={m} {f[f'm{m}']['speedup_vs_bf16']:.2f}x" for m in ms)
        text = f"{kind} ({f['path']}) err {f['worst_rel_err']:.1e}, vs bf16: {ratios}"
        (notes if f["ok"] else problems).append(text if f["ok"] else f"{text} (above {MAX_REL_ERR[kind]:.0e})")
    return ("fail" if problems else "pass"), "; ".join(problems + notes), figures
