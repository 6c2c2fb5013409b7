"""`make gpu-check`: one script that checks and measures the engine on a GPU machine (no network, < 10 min).

- It prints a summary table and writes one JSON file; `--quick --device cpu` smokes the same code on the CPU (tiny
  shapes, Triton in its interpreter) under `make test`.
- Steps, in order, each timed, each failure caught and reported without stopping the rest:
    1 versions          python, torch, triton, transformers, CUDA, the device
    2 kernels           tests/kernels natively on the device (pytest in subprocesses, sharded)
    3 quant             int8 (Triton W8A16) and FP8 weight GEMMs vs reference, timed vs bf16
    4 parity            CPU fp32 = device fp32 greedy tokens; device bf16's first divergence
    5 batch_invariance  16 requests in one batch = each alone (device fp32)
    6 lora_parity       8 adapters and base mixed in one batch: CPU fp32 = device fp32
    7 profile           one decode step at batch 64: kernels, GPU busy / wall, no gather inside attention
    8 throughput        decode tok/s at batch 1 and 64 vs HF transformers and the roofline
    9 lora_throughput   batch 64 with no adapter, one adapter, 8 adapters
   10 graphs            decode step ms at batch 1 and 64, cuda_graphs off vs on, greedy tokens identical
   11 sampled           64 sampled requests: tok/s vs greedy; seeded ones in the batch = alone
   12 adapter_load      32 requests decoding: step p99 while an unread adapter loads vs without
   13 memory            default KV sizing on the card (small, llama3-8b) and a maximum-size step
- Statuses: pass, fail (a check did not hold), error (the step raised), skip. The exit code is 1 when any step failed
  or raised.
- The JSON (rewritten after each step; "complete" once all ran): {"tool", "schema", "complete", "ok", "started_at",
  "total_s", "args", "device", "versions",
  "steps": {name: {"index", "title", "status", "seconds", "summary", "figures", "error"}}}.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.cli.bench import roofline

REPO = Path(__file__).resolve().parents[3]
SCHEMA = 1
PACKAGES = ("triton", "transformers", "peft", "safetensors", "tokenizers", "jinja2", "numpy", "llguidance", "pytest")
# Longest bench_prompts() prompt in byte-level tokens, rounded up: sizes the engines' KV pools
PROMPT_TOKENS_MAX = 200
# --quick: Triton interpreter tests per kernel family (the cheapest shapes first where known)
QUICK_KINDS = ("sgmv", "bgmv", "paged")
QUICK_PER_KIND = 1
QUICK_PREFER = "fused_slices"
KERNEL_TESTS_MAX_S = 240  # the kernel tests' share of the run (Triton compiles every shape on first use)


@dataclass
class CheckContext:
    """One run's settings, deadline, scratch directory and the model it keeps between steps."""

    device: torch.device
    quick: bool
    new_tokens: int
    rounds: int
    deadline: float  # time.monotonic() after which no further step starts
    work_dir: Path
    kernel_filter: list[str] | None = None  # substrings of the kernel test ids to run (None: all)
    kernel_shards: int = 0  # 0: by CPU count
    with_hf: bool = True
    _models: dict = field(default_factory=dict)
    _adapters: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def perf_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    @property
    def parity_preset(self) -> str:
        return "tiny" if self.quick else "small"

    @property
    def parity_tokens(self) -> int:
        return 16 if self.quick else 32

    @property
    def perf_presets(self) -> tuple[str, ...]:
        """Shapes of the profile and throughput steps (8B only on CUDA: 32 GB in fp32 on a host)."""
        return ("tiny",) if self.quick else ("small", "llama3-8b") if self.cuda else ("small",)

    @property
    def batch(self) -> int:
        return 4 if self.quick else 64

    @property
    def lora_batch(self) -> int:
        return 8 if self.quick else 64

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def traced_backend(self) -> str:
        """The profiled engine's attention backend: auto (triton_paged on CUDA); on the CPU under
        TRITON_INTERPRET=1 the Triton kernels themselves, in the interpreter (too slow for the other steps)."""
        if not self.cuda and os.environ.get("TRITON_INTERPRET") == "1":
            return "triton_paged"
        return "auto"

    def engine(self, loaded, dtype: torch.dtype, device: torch.device | None = None, max_num_seqs: int = 64,
               **overrides):
        """An EngineCore over `loaded`: no speculation, no prefix cache (one token per step, every prompt
        computed), KV blocks for `max_num_seqs` prompts and their new tokens; `overrides` replace any
        EngineConfig field."""
        from loraplex.engine.config import EngineConfig
        from loraplex.engine.core import EngineCore

        block = 16
        per_seq = -(-(PROMPT_TOKENS_MAX + max(self.new_tokens, self.parity_tokens) + block) // block)
        params = {"model": loaded.name, "device": str(device or self.device), "dtype": roofline.dtype_name(dtype),
                  "attention_backend": "auto", "speculative_tokens": 0, "enable_prefix_caching": False,
                  "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 4096, "block_size": block,
                  "num_kv_blocks": max_num_seqs * per_seq}
        params.update(overrides)
        return EngineCore(EngineConfig(**params), loaded=loaded)

    def model(self, preset: str, dtype: torch.dtype):
        """synthetic:<preset> made on the device (kept for the next step: one model at a time)."""
        from loraplex.engine.models.loader import load_model, resolve_model

        key = (preset, dtype)
        if key not in self._models:
            self._models.clear()
            self.free()
            self._models[key] = load_model(resolve_model(f"synthetic:{preset}"), dtype, self.device)
        return self._models[key]

    def adapters(self, config, preset: str, count: int, rank: int) -> list[Path]:
        """`count` random rank-`rank` PEFT adapters for a model's shapes, written once per run."""
        from loraplex.cli.bench.synthetic_adapters import write_adapter

        key = (preset, count, rank)
        if key not in self._adapters:
            root = self.work_dir / f"adapters-{preset}-r{rank}"
            self._adapters[key] = [write_adapter(root / f"a{i}", config, rank=rank, seed=100 + i) for i in range(count)]
        return self._adapters[key]

    def free(self) -> None:
        """Returns what finished engines held to the device (the kept model stays)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


# --- 1. versions and device -------------------------------------------------------------------------


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    if device.type != "cuda":
        return {**info, "name": info["cpu"]}
    p = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    info.update(name=p.name, index=device.index, total_memory_gib=round(total / 2**30, 2),
                free_memory_gib=round(free / 2**30, 2), compute_capability=f"{p.major}.{p.minor}",
                multiprocessors=p.multi_processor_count)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        info["driver"] = None
    return info


def versions(ctx: CheckContext) -> tuple[str, str, dict]:
    """Versions and the device; fails when an engine dependency does not import."""
    v, dev = package_versions(), device_info(ctx.device)
    broken = {}
    for name in ("triton", "llguidance", "transformers"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (a binary wheel can fail in many ways)
            broken[name] = f"{type(e).__name__}: {e}"
    figures = {"versions": v, "device": dev, "import_errors": broken}
    where = f"{dev['name']}" + (f" ({dev['total_memory_gib']} GiB, sm {dev['compute_capability']})" if ctx.cuda else "")
    summary = f"{where}; torch {v['torch']} (CUDA {v['cuda']}), triton {v['triton']}, transformers {v['transformers']}"
    if broken:
        summary += "; cannot import " + ", ".join(broken) + (" (make gpu-wheels)" if "llguidance" in broken else "")
    return ("fail" if broken else "pass"), summary, figures


# --- 2. kernel tests ----------------------------------------------------------------------------------

# Set in the pytest subprocesses, where this module is loaded as a plugin (-p): which share of the collected
# tests that process runs, as JSON {"index", "count", "quick", "filter", "report"}.
SHARD_ENV = "LORAPLEX_GPU_CHECK_SHARD"
PLUGIN = "loraplex.cli.bench.gpu_check"  # (this module; __name__ is __main__ under python -m)


def quick_subset(ids: list[str]) -> list[str]:
    """A few tests of each kernel family, the known-cheap ones first: enough to run each kernel once."""
    chosen = []
    for kind in QUICK_KINDS:
        mine = [i for i in ids if kind in i.lower() and i not in chosen]
        mine.sort(key=lambda i: QUICK_PREFER not in i)  # stable: collection order otherwise
        chosen += mine[:QUICK_PER_KIND]
    return chosen


def pytest_collection_modifyitems(config, items) -> None:
    """(pytest hook, in the subprocesses only) Keeps this shard's tests: --kernel-filter's, the quick subset
    in --quick, then every count-th from index; writes the counts to the shard's report file."""
    spec = os.environ.get(SHARD_ENV)
    if not spec:
        return
    shard = json.loads(spec)
    ids = [item.nodeid for item in items]
    if shard["filter"]:
        ids = [i for i in ids if any(f in i for f in shard["filter"])]
    selected = quick_subset(ids) if shard["quick"] else ids
    keep = set(selected[shard["index"]::shard["count"]])
    dropped = [item for item in items if item.nodeid not in keep]
    items[:] = [item for item in items if item.nodeid in keep]
    config.hook.pytest_deselected(items=dropped)
    Path(shard["report"]).write_text(json.dumps({"collected": len(dropped) + len(items), "selected": len(selected)}))


def parse_junit(path: Path) -> dict[str, list[str]]:
    """Test names by outcome (passed, failed, skipped) from a pytest --junitxml file."""
    out: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        out["failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"].append(name)
    return out


def run_shards(ctx: CheckContext, shards: int) -> dict:
    """tests/kernels in `shards` concurrent pytest processes (Triton compiles on every core), natively on
    CUDA or in the interpreter on the CPU, no plugins but this module; their outcomes merged."""
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", PLUGIN, "-o", "addopts=",
            "--continue-on-collection-errors"]
    if ctx.cuda:
        env.pop("TRITON_INTERPRET", None)
        args += ["--device", "cuda", "tests/kernels"]
    else:  # the Triton kernels' files only: collecting the C kernels' tests would build them
        env["TRITON_INTERPRET"] = "1"
        args += sorted(str(f.relative_to(REPO)) for f in (REPO / "tests" / "kernels").glob("test_*.py")
                       if not f.name.startswith("test_cpu_"))
    procs = []
    for s in range(shards):
        xml, report, log = (ctx.work_dir / f"kernels-{s}.{ext}" for ext in ("xml", "json", "log"))
        env[SHARD_ENV] = json.dumps({"index": s, "count": shards, "quick": ctx.quick, "filter": ctx.kernel_filter,
                                     "report": str(report)})
        with open(log, "w") as out:
            procs.append((subprocess.Popen([*args, f"--junitxml={xml}"], cwd=REPO, env=dict(env), stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True), xml, report, log))
    res: dict = {"passed": [], "failed": [], "skipped": [], "collected": 0, "selected": 0, "timed_out": False,
                 "process_errors": []}
    end = time.monotonic() + max(30.0, min(KERNEL_TESTS_MAX_S, ctx.time_left() - 60))
    for proc, xml, report, log in procs:
        try:
            proc.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            res["timed_out"] = True
            os.killpg(proc.pid, 9)
            proc.wait()
        if xml.exists():
            for k, names in parse_junit(xml).items():
                res[k] += names
        if report.exists():
            counts = json.loads(report.read_text())
            res["collected"], res["selected"] = counts["collected"], counts["selected"]
        else:
            res["process_errors"].append(f"shard {report.stem}: the {PLUGIN} plugin selected nothing")
        if proc.returncode not in (0, 1, 5) or not xml.exists():  # 5: nothing selected in this shard
            res["process_errors"].append(f"exit {proc.returncode}: " + log.read_text(errors="replace")[-1500:])
    return res


def kernels(ctx: CheckContext) -> tuple[str, str, dict]:
    """tests/kernels on the device against their references (on the CPU: one per family, in the interpreter)."""
    shards = 1 if ctx.quick else (ctx.kernel_shards or max(1, min(8, (os.cpu_count() or 2) // 2)))
    res = run_shards(ctx, shards)
    done = {k: len(res[k]) for k in ("passed", "failed", "skipped")}
    unreported = res["selected"] - sum(done.values())
    figures = {"collected": res["collected"], "selected": res["selected"], "shards": shards,
               "interpreter": not ctx.cuda, "filter": ctx.kernel_filter, **done, "unreported": unreported,
               "failing": res["failed"][:30], "timed_out": res["timed_out"],
               "process_errors": res["process_errors"][:2]}
    ok = (done["passed"] and not done["failed"] and unreported == 0 and not res["process_errors"]
          and not res["timed_out"])
    summary = f"{done['passed']} passed, {done['failed']} failed, {done['skipped']} skipped of {res['selected']}"
    if res["selected"] != res["collected"]:
        summary += f" (of {res['collected']} collected)"
    if res["failed"]:
        summary += "; failing: " + ", ".join(res["failed"][:3]) + (" ..." if len(res["failed"]) > 3 else "")
    for flag, text in ((res["timed_out"], "timed out"), (unreported, f"{unreported} unreported"),
                       (res["process_errors"], "pytest exited abnormally")):
        if flag:
            summary += f"; {text}"
    return ("pass" if ok else "fail"), summary, figures


# --- the runner ---------------------------------------------------------------------------------------


def _engine_step(name: str, module: str = "gpu_check_steps") -> Callable[[CheckContext], tuple[str, str, dict]]:
    """A step of gpu_check_steps (or `module`), imported when it runs (an engine import error is that step's
    error)."""
    return lambda ctx: getattr(importlib.import_module(f"loraplex.cli.bench.{module}"), name)(ctx)


STEPS: list[tuple[str, str, Callable[[CheckContext], tuple[str, str, dict]]]] = [
    ("versions", "versions and device", versions),
    ("kernels", "Triton kernels vs reference (tests/kernels)", kernels),
    ("quant", "int8 / FP8 weight GEMMs vs reference and bf16", _engine_step("quant", "gpu_check_quant")),
    ("parity", "greedy tokens: CPU fp32 vs device fp32, device bf16", _engine_step("parity")),
    ("batch_invariance", "batch of 16 vs each request alone", _engine_step("batch_invariance")),
    ("lora_parity", "8 mixed adapters: CPU fp32 vs device fp32", _engine_step("lora_parity")),
    ("profile", "one profiled decode step at batch 64", _engine_step("profile")),
    ("throughput", "decode tok/s vs HF transformers and roofline", _engine_step("throughput")),
    ("lora_throughput", "LoRA tok/s: identical / 8 adapters vs base", _engine_step("lora_throughput")),
    ("graphs", "decode step time, CUDA graphs off vs on", _engine_step("graphs", "gpu_check_engine")),
    ("sampled", "sampled batch: tok/s vs greedy, seeds vs alone", _engine_step("sampled", "gpu_check_engine")),
    ("adapter_load", "step p99 while an adapter is read", _engine_step("adapter_load", "gpu_check_engine")),
    ("memory", "KV cache sized by measurement, max step", _engine_step("memory", "gpu_check_engine")),
]
NAMES = [s[0] for s in STEPS]


def select_steps(only: str | None, skip: str | None) -> set[str]:
    """Step names from --only / --skip lists of names or numbers (1-based)."""
    def names(spec: str) -> set[str]:
        out = set()
        for item in filter(None, (s.strip() for s in spec.split(","))):
            if item.isdigit() and 1 <= int(item) <= len(NAMES):
                out.add(NAMES[int(item) - 1])
            elif item in NAMES:
                out.add(item)
            else:
                raise SystemExit(f"gpu_check: unknown step {item!r} (steps: {', '.join(NAMES)} or 1-{len(NAMES)})")
        return out

    chosen = names(only) if only else set(NAMES)
    return chosen - (names(skip) if skip else set())


def run_step(ctx: CheckContext, index: int, name: str, title: str, fn, chosen: set[str]) -> dict:
    record = {"index": index, "title": title, "status": "skip", "seconds": 0.0, "summary": "", "figures": {},
              "error": None}
    print(f"[{index}/{len(STEPS)}] {name}: {title}", flush=True)
    if name not in chosen:
        record["summary"] = "not selected (--only/--skip)"
    elif ctx.time_left() <= 0:
        record["summary"] = "time budget spent"
    else:
        t0 = time.perf_counter()
        try:
            record["status"], record["summary"], record["figures"] = fn(ctx)
        except Exception as e:  # noqa: BLE001 (a failing step must not stop the others)
            record.update(status="error", summary=f"{type(e).__name__}: {e}"[:300],
                          error=traceback.format_exc()[-4000:])
        record["seconds"] = round(time.perf_counter() - t0, 2)
        ctx.free()
    print(f"    {record['status'].upper()} {record['seconds']:.1f}s  {record['summary']}", flush=True)
    if record["error"]:
        print("    " + record["error"].rstrip().replace("\n", "\n    "), flush=True)
    return record


def summary_table(report: dict) -> str:
    dev = report["device"]
    lines = ["", f"gpu-check summary: {dev.get('name')} ({report['args']['device']}), "
                 f"{'quick' if report['args']['quick'] else 'full'}, {report['total_s']:.0f} s",
             f"{'#':>2}  {'step':<17} {'status':<6} {'time':>7}  summary"]
    for name, s in report["steps"].items():
        text = s["summary"] if len(s["summary"]) <= 110 else s["summary"][:107] + "..."
        lines.append(f"{s['index']:>2}  {name:<17} {s['status']:<6} {s['seconds']:>6.1f}s  {text}")
    counts = {st: sum(s["status"] == st for s in report["steps"].values()) for st in ("pass", "fail", "error", "skip")}
    lines.append(f"overall: {'OK' if report['ok'] else 'FAILED'} ("
                 + ", ".join(f"{n} {st}" for st, n in counts.items() if n) + ")")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loraplex.cli.bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda or cuda:N")
    p.add_argument("--quick", action="store_true", help="tiny shapes, a few kernel tests, batch 1 and 4")
    p.add_argument("--json", default="bench/results/gpu-check.json", help="where to write the report")
    p.add_argument("--only", help=f"steps to run, by name or number: {','.join(NAMES)}")
    p.add_argument("--skip", help="steps not to run, by name or number")
    p.add_argument("--budget-s", type=float, default=None, help="no step starts after this (default 540, quick 300)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per request, throughput (default 64, quick 16)")
    p.add_argument("--rounds", type=int, default=None, help="throughput rounds, best kept (default 2, quick 1)")
    p.add_argument("--kernel-filter", default=None, help="comma-separated substrings of the kernel test ids to run")
    p.add_argument("--kernel-shards", type=int, default=0, help="pytest processes at once (default CPUs/2, max 8)")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers baseline")
    return p.parse_args(argv)


def write_report(path: Path, args: argparse.Namespace, ctx: CheckContext, started: datetime.datetime, t0: float,
                 device: dict, steps: dict[str, dict], complete: bool) -> dict:
    """The JSON, rewritten after every step: a run cut short still leaves the steps it finished."""
    report = {"tool": "loraplex gpu-check", "schema": SCHEMA, "complete": complete,
              "ok": complete and not any(s["status"] in ("fail", "error") for s in steps.values()),
              "started_at": started.isoformat(timespec="seconds"), "total_s": round(time.perf_counter() - t0, 1),
              "args": {"device": str(ctx.device), "quick": ctx.quick, "only": args.only, "skip": args.skip,
                       "budget_s": args.budget_s, "new_tokens": ctx.new_tokens, "rounds": ctx.rounds},
              "device": device, "versions": package_versions(), "steps": steps}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, t0 = datetime.datetime.now(datetime.UTC), time.perf_counter()
    device = roofline.resolve_device(args.device)
    if args.budget_s is None:
        args.budget_s = 300.0 if args.quick else 540.0
    chosen = select_steps(args.only, args.skip)
    out, info = Path(args.json), device_info(device)
    steps: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="loraplex-gpu-check-") as tmp:
        ctx = CheckContext(device=device, quick=args.quick, new_tokens=args.new_tokens or (16 if args.quick else 64),
                           rounds=args.rounds or (1 if args.quick else 2), deadline=time.monotonic() + args.budget_s,
                           work_dir=Path(tmp),
                           kernel_filter=args.kernel_filter.split(",") if args.kernel_filter else None,
                           kernel_shards=args.kernel_shards, with_hf=not args.skip_hf)
        mode = "quick" if args.quick else "full"
        print(f"loraplex gpu-check on {device} ({info['name']}; {mode}, budget {args.budget_s:.0f} s)", flush=True)
        for index, (name, title, fn) in enumerate(STEPS, 1):
            steps[name] = run_step(ctx, index, name, title, fn, chosen)
            write_report(out, args, ctx, started, t0, info, steps, complete=False)
        ctx._models.clear()
    report = write_report(out, args, ctx, started, t0, info, steps, complete=True)
    print(summary_table(report), flush=True)
    print(f"JSON: {out}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
