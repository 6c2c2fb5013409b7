"""Builds this directory's C kernels once per machine and loads them with ctypes.

Why C and not a torch extension: the kernels need no torch headers, so a build needs only the system's
`cc`, neither ninja nor pybind11. Each source compiles in its own `cc` process, as many at once as this
process may use cores (a minute and a half on one core; the largest source takes about 12 s), then one
link. They run their parallel loops
on OpenMP; torch ships `libgomp.so.1` and has it loaded before this library, so both share one
OpenMP runtime and one thread pool (two runtimes would fight over the same cores).

The shared object is cached under `<cache dir>/kernels/`, keyed by the sources, the flags, the
compiler and the CPU, and written atomically. Processes starting together (a node's replicas) build it once:
the first takes a lock on the cache folder, the others wait for it and then load its build. When
there is no compiler, the build fails, or LORAPLEX_CPU_KERNELS=0, `library()` is None and callers use
torch ops; `status()` says which and why.

- Users build without `-Werror` (a new compiler's warning must not cost them the kernels); CI adds it
  through LORAPLEX_CPU_CFLAGS=-Werror (the Makefile's `test` target), which is part of the cache key.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch  # (loads torch's libgomp before this library, see the docstring)

from loraplex.engine.config import default_cache_dir

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
# The element types of LoRA slot buffers and their codes in the kernels' tables (lora_weights.h, LP_W_*)
WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-Wall"]


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
    """$CC (default `cc`) when it is on PATH and runs (`--version` succeeds), else None."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    return cc if cc is not None and _runs(cc) else None


@functools.cache
def _runs(cc: str) -> bool:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


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
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')!r} is not on PATH or does not run)")
    out_dir = (cache_dir or default_cache_dir()) / "kernels"
    target = out_dir / f"loraplex_cpu-{_key(cc)}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        if target.exists():  # built by the process that held the lock
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            _compile(cc, out_dir, tmp)
            os.replace(tmp, target)  # atomic: a reader never sees half a library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _compile(cc: str, work_dir: Path, out: str) -> None:
    """Each source to an object file (in parallel, see the module docstring), then one link into `out`.
    Raises RuntimeError with the first failing step's message."""
    with tempfile.TemporaryDirectory(dir=work_dir) as objects, ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
        jobs = {src: os.path.join(objects, f"{src.stem}.o") for src in sources()}
        for done in pool.map(_run, [[cc, *flags(), "-c", str(src), "-o", obj] for src, obj in jobs.items()]):
            _check(done)
        _check(_run([cc, *flags(), *jobs.values(), "-o", out]))


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def _check(done: subprocess.CompletedProcess) -> None:
    if done.returncode:
        said = done.stderr.strip()
        first = next((line for line in said.splitlines() if "error" in line), said[:200] or "no message")
        raise RuntimeError(f"compile error (exit {done.returncode}): {first.strip()[:300]}\n{said[:2000]}")


@dataclass(frozen=True)
class KernelStatus:
    """What loading the kernels came to: `loaded`, or why torch ops run instead (`reason`, one line;
    `detail`: the compiler's whole message, when it failed)."""

    loaded: bool
    reason: str
    detail: str = ""


_status = KernelStatus(False, "not loaded yet")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, no compiler, or a failed build: a WARNING, once)."""
    global _status
    if not enabled():
        _status = KernelStatus(False, "switched off by LORAPLEX_CPU_KERNELS=0")
        return None
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as e:
        message = str(e)
        _status = KernelStatus(False, message.splitlines()[0] if message else type(e).__name__, message)
        log.warning("CPU kernels not built (%s): falling back to torch ops, which are slower "
                    "(`loraplex doctor` says more)", _status.reason)
        return None
    _status = KernelStatus(True, f"built with {' '.join(flags())} ({path.name})")
    return lib


def status() -> KernelStatus:
    """Loads the kernels if no one has yet, and says whether they run and why not."""
    library()
    return _status


# The compiler's macros for the instruction sets the kernels have code for, and their names
ISA_MACROS = {"__AVX512F__": "AVX-512F", "__AVX512BW__": "AVX-512BW", "__AVX512VL__": "AVX-512VL",
              "__AVX512VNNI__": "AVX-512 VNNI", "__AVX512BF16__": "AVX-512 BF16", "__AVXVNNI__": "AVX-VNNI",
              "__AVX2__": "AVX2", "__FMA__": "FMA", "__F16C__": "F16C"}
# /proc/cpuinfo's names of the same, for when there is no compiler to ask
CPUINFO_FLAGS = {"avx512f": "AVX-512F", "avx512bw": "AVX-512BW", "avx512vl": "AVX-512VL",
                 "avx512_vnni": "AVX-512 VNNI", "avx512_bf16": "AVX-512 BF16", "avx_vnni": "AVX-VNNI",
                 "avx2": "AVX2", "fma": "FMA", "f16c": "F16C"}


def build_instruction_sets(extra_flags: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The instruction sets a build with flags() (plus extra_flags) targets (the compiler's predefined macros),
    or None without a working compiler."""
    cc = _compiler()
    if cc is None:
        return None
    compile_flags = [f for f in (*flags(), *extra_flags) if f not in ("-shared", "-Werror")]
    try:
        done = subprocess.run([cc, *compile_flags, "-dM", "-E", "-x", "c", "-"], input="", capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode:
        return None
    defined = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    return tuple(name for macro, name in ISA_MACROS.items() if macro in defined)


def cpu_instruction_sets() -> tuple[str, ...]:
    """The instruction sets this CPU reports (of those the kernels have code for)."""
    present = set(_cpu_id().split())
    return tuple(name for flag, name in CPUINFO_FLAGS.items() if flag in present)


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
