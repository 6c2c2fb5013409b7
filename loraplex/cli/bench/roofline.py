"""Roofline figures of the benchmarked device, measured in the same run as the benchmark they bound, and
the device plumbing every benchmark shares (the --device/--dtype rules, a synchronised clock, what ran where).

CUDA work is queued, so a clock read straight after a call measures the launch, not the work: every timed
region here reads the clock through `clock(device)`, which waits for the device first.
"""

from __future__ import annotations

import platform
import re
import time
from collections.abc import Callable

import torch

from loraplex.engine.config import EngineConfig, default_device

# Read bandwidth buffer: far larger than the caches (a CPU's L3, an H100's 50 MiB L2).
CPU_READ_BYTES = 512 * 1024 * 1024
CUDA_READ_BYTES = 2 * 1024 * 1024 * 1024
# Square GEMM sizes: large enough to run at the dense rate (fp32 on the CPU, tensor cores on CUDA).
CPU_GEMM_N = 2048
CUDA_GEMM_N = 8192


def resolve_device(device: str) -> torch.device:
    """--device: auto (cuda when present, else cpu), cpu, cuda or cuda:N; a CUDA device must exist here.
    "cuda" becomes the current CUDA device's index, so tensors' devices compare equal to it."""
    if device == "auto":
        device = default_device()
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__})")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """--dtype: auto|float32|bfloat16|float16, "auto" by EngineConfig.torch_dtype's rule (bf16 on CUDA,
    fp32 on the CPU); EngineConfig also refuses any other name."""
    return EngineConfig(device=str(device), dtype=dtype).torch_dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sync(device: torch.device | str) -> None:
    """Waits for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | str) -> float:
    """time.perf_counter() once the device's queued work is done: the clock every timed region reads."""
    sync(device)
    return time.perf_counter()


def best_seconds(fn: Callable[[], object], repeats: int, device: torch.device | str = "cpu", iters: int = 1) -> float:
    """Seconds per call of fn: one warm-up call, then the best of `repeats` timings of `iters` calls each
    (several calls per timing amortise the sync on CUDA, where one call is microseconds)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock(device)
        for _ in range(iters):
            fn()
        best = min(best, (clock(device) - t0) / iters)
    return best


def machine(device: torch.device, dtype: torch.dtype) -> dict:
    """What ran the benchmark: the device and its name, the dtype, the host's CPU and threads, torch and triton."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cpu = platform.processor() or platform.machine()
    return {"device": str(device), "dtype": dtype_name(dtype), "cpu": cpu, "threads": torch.get_num_threads(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
            "torch": torch.__version__, "triton": triton_version}


def mem_read_gbs(num_bytes: int = CPU_READ_BYTES, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Streaming read bandwidth: a sum over a buffer far larger than the caches."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    iters = 10 if torch.device(device).type == "cuda" else 1
    return num_bytes / best_seconds(lambda: x.sum(), repeats, device, iters) / 1e9


def gemm_gflops(n: int = CPU_GEMM_N, dtype: torch.dtype = torch.float32, repeats: int = 5,
                device: torch.device | str = "cpu") -> float:
    """Dense GEMM rate on a large square matmul."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    iters = 10 if torch.device(device).type == "cuda" else 1
    return 2 * n**3 / best_seconds(lambda: a @ b, repeats, device, iters) / 1e9


def measure(device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None) -> dict[str, float]:
    """{"mem_read_gbs", "gemm_gflops"} of `device`, the GEMM at `dtype` (a name as --dtype takes; None or "auto":
    the device's default, bf16 on CUDA and fp32 on the CPU). CPU: 512 MiB read, n=2048; CUDA: 2 GiB, n=8192."""
    device = torch.device(device)
    if dtype is None or isinstance(dtype, str):
        dtype = resolve_dtype(dtype or "auto", device)
    cuda = device.type == "cuda"
    read = mem_read_gbs(CUDA_READ_BYTES if cuda else CPU_READ_BYTES, device=device)
    gemm = gemm_gflops(CUDA_GEMM_N if cuda else CPU_GEMM_N, dtype, device=device)
    return {"mem_read_gbs": round(read, 2), "gemm_gflops": round(gemm, 1)}
