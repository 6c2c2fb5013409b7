"""Builds this directory's C kernels once per machine and loads them with ctypes.

Why C and not a torch extension: the kernels need no torch headers, so a build takes a few
seconds with the system's `cc` and needs neither ninja nor pybind11. They run their parallel loops
on OpenMP; torch ships `libgomp.so.1` and has it loaded before this library, so both share one
OpenMP runtime and one thread pool (two runtimes would fight over the same cores).

The shared object is cached under `<cache dir>/kernels/`, keyed by the sources, the flags, the
compiler and the CPU, and written atomically, so concurrent processes can build it at once. When
there is no compiler, or LORAPLEX_CPU_KERNELS=0, `library()` is None and callers use torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # (loads torch's libgomp before this library, see the docstring)

from loraplex.engine.config import default_cache_dir

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
# The element types of LoRA slot buffers and their codes in the kernels' tables (lora_weights.h, LP_W_*)
WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-Wall", "-Werror"]


def flags() -> list[str]:
    """FLAGS plus LORAPLEX_CPU_CFLAGS (split on spaces): e.g. `-mno-avx512f` builds the AVX2 kernels on
    an AVX-512 machine, to test or compare both."""
    return FLAGS + os.environ.get("LORAPLEX_CPU_CFLAGS", "").split()


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def headers() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.h"))


def enabled() -> bool:
    return os.environ.get("LORAPLEX_CPU_KERNELS", "1") != "0"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _key(cc: str) -> str:
    h = hashlib.sha256()
    for src in sources() + headers():
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    for part in (" ".join(flags()), version, _cpu_id()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def build(cache_dir: Path | None = None) -> Path:
    """Compiles the sources (unless the cache has them) and returns the shared object's path.
    Raises RuntimeError with the compiler's message when the build fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')!r} is not on PATH)")
    out_dir = (cache_dir or default_cache_dir()) / "kernels"
    target = out_dir / f"loraplex_cpu-{_key(cc)}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags(), *map(str, sources()), "-o", tmp], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the CPU kernels failed: {done.stderr.strip()[:2000]}")
        os.replace(tmp, target)  # atomic: a concurrent build loses nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, no compiler, or a failed build: logged once)."""
    if not enabled():
        return None
    try:
        return ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        log.warning("CPU kernels unavailable, using torch ops instead: %s", e)
        return None


def function(name: str, restype, argtypes: list):
    """One exported C function with its ctypes signature set, or None when library() is None.
    Pointers are passed as ctypes.c_void_p (tensor.data_ptr()), sizes as ctypes.c_int64."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def functions(signatures: dict[str, tuple]) -> dict | None:
    """Several exported functions at once, {name: (restype, argtypes)} -> {name: function}, or None
    when any is missing (a wrapper module's kernels are all there or none is used)."""
    fns = {name: function(name, *sig) for name, sig in signatures.items()}
    return None if any(f is None for f in fns.values()) else fns


def require(name: str, t, ndim: int, dtype=None, rows: bool = False) -> None:
    """Checks a tensor handed to a kernel: dimensions, dtype (fp32 by default), CPU, and layout
    (contiguous, or with `rows` only the last dimension dense, for row views)."""
    dtype = dtype or torch.float32
    dense = t.stride(-1) == 1 if rows else t.is_contiguous()
    if t.dim() != ndim or t.dtype != dtype or t.device.type != "cpu" or not dense:
        raise ValueError(f"{name} must be a {'row-dense' if rows else 'contiguous'} {ndim}-d {dtype} CPU tensor, "
                         f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
