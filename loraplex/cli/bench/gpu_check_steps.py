"""gpu-check's engine steps (4-9): greedy-token parity across devices, dtypes, batches and adapters, one
profiled decode step, and throughput against HF transformers and the roofline.

Every step takes the run's CheckContext (gpu_check.py) and returns (status, one-line summary, figures);
an exception is the runner's to report. Kept apart from gpu_check.py so that a box missing an engine
dependency still runs and reports steps 1-2.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from loraplex.cli.bench import roofline
from loraplex.cli.bench.engine import _hf, _ours, bench_prompts, flops_per_token, hf_model, interleaved_rounds
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.core import EngineCore
from loraplex.engine.models.loader import LoadedModel, load_model, resolve_model

if TYPE_CHECKING:
    from loraplex.cli.bench.gpu_check import CheckContext

Outcome = tuple[str, str, dict]
FP32, BF16 = torch.float32, torch.bfloat16
PARITY_PROMPTS = 3
INVARIANCE_BATCH = 16
NUM_ADAPTERS = 8
PARITY_RANK, PERF_RANK = 8, 16
SPEEDUP_TARGET = 3.0  # llama3-8b at batch 64 against HF transformers, on the GPU
# The profiled step's attention range, and what must not run inside it: a backend that reads K/V in place
# launches no gather of the cache (aten::index is advanced indexing, a gather too).
ATTN_RANGE = "loraplex.attention"
GATHER_OPS = {"aten::index_select", "aten::gather", "aten::index", "aten::take"}
GATHER_KERNEL = re.compile(r"index_?select|gather", re.IGNORECASE)


# --- shared helpers ---------------------------------------------------------------------------------


def greedy_requests(model: str, prompts: list[str], new_tokens: int, adapters: list[str | None] | None = None,
                    tag: str = "r") -> list[GenerateRequest]:
    """Greedy requests of exactly `new_tokens` tokens (EOS ignored), one per prompt, with optional adapters."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    adapters = adapters or [None] * len(prompts)
    return [GenerateRequest(f"{tag}{i}", model, prompt=p, sampling=sp, adapter=a)
            for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))]


def run_tokens(core: EngineCore, requests: list[GenerateRequest]) -> list[list[int]]:
    """Every request's generated token ids, in the order given (all in one batch)."""
    return [c.token_ids for c in core.run(requests)]


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    """Where greedy outputs part: per diverging request its first differing position, and the first of all."""
    diverged = []
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        pos = next((p for p, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if pos is None and len(a) != len(b):
            pos = min(len(a), len(b))
        if pos is not None:
            diverged.append({"request": i, "position": pos, "got": a[pos] if pos < len(a) else None,
                             "want": b[pos] if pos < len(b) else None})
    first = min(diverged, key=lambda d: (d["position"], d["request"])) if diverged else None
    return {"identical": not diverged, "requests": len(want), "tokens_per_request": len(want[0]) if want else 0,
            "diverged_requests": len(diverged), "first_divergence": first, "divergences": diverged[:16]}


def _where(c: dict) -> str:
    d = c["first_divergence"]
    return "identical" if d is None else (f"{c['diverged_requests']}/{c['requests']} requests differ, first at "
                                          f"request {d['request']} token {d['position']}")


def moved(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The same weights on another device or dtype (the CPU's values, so two devices compare alike)."""
    return dataclasses.replace(loaded, weights={k: v.to(device=device, dtype=dtype) for k, v in loaded.weights.items()})


def cpu_model(preset: str) -> LoadedModel:
    return load_model(resolve_model(f"synthetic:{preset}"), FP32, torch.device("cpu"))


def _tok_s(core: EngineCore, requests: list[GenerateRequest]) -> float:
    """Tokens per second of one batch, the device synchronised at both ends."""
    device = core.config.torch_device
    t0 = roofline.clock(device)
    tokens = sum(len(t) for t in run_tokens(core, requests))
    return tokens / (roofline.clock(device) - t0)


# --- 3. parity across devices and dtypes --------------------------------------------------------------


def parity(ctx: CheckContext) -> Outcome:
    """CPU fp32 and device fp32 greedy tokens must be identical; device bf16's first divergence is reported."""
    preset, n_tok = ctx.parity_preset, ctx.parity_tokens
    cpu = cpu_model(preset)
    reqs = greedy_requests(cpu.name, bench_prompts(PARITY_PROMPTS), n_tok)
    n = len(reqs)
    want = run_tokens(ctx.engine(cpu, FP32, device=torch.device("cpu"), max_num_seqs=n), reqs)
    got32 = run_tokens(ctx.engine(moved(cpu, ctx.device, FP32), FP32, max_num_seqs=n), reqs)
    got16 = run_tokens(ctx.engine(moved(cpu, ctx.device, BF16), BF16, max_num_seqs=n), reqs)
    fp32, bf16 = compare(got32, want), compare(got16, got32)
    figures = {"model": cpu.name, "new_tokens": n_tok,
               "cpu_fp32_vs_device_fp32": fp32, "device_bf16_vs_device_fp32": bf16}
    summary = f"{preset}: device fp32 vs CPU fp32 {_where(fp32)}; bf16 vs fp32 {_where(bf16)}"
    return ("pass" if fp32["identical"] else "fail"), summary, figures


# --- 4. batch invariance --------------------------------------------------------------------------------


def batch_invariance(ctx: CheckContext) -> Outcome:
    """A batch of 16 greedy requests on the device must give each request the tokens it gets alone (fp32)."""
    loaded = moved(cpu_model(ctx.parity_preset), ctx.device, FP32)
    core = ctx.engine(loaded, FP32, max_num_seqs=INVARIANCE_BATCH)
    reqs = greedy_requests(loaded.name, bench_prompts(INVARIANCE_BATCH), ctx.parity_tokens)
    batched = run_tokens(core, reqs)
    alone = [run_tokens(core, [r])[0] for r in reqs]
    c = compare(batched, alone)
    figures = {"model": loaded.name, "dtype": "float32", "batch": len(reqs), "new_tokens": ctx.parity_tokens,
               "batch_vs_alone": c}
    return ("pass" if c["identical"] else "fail"), f"batch {len(reqs)} vs alone: {_where(c)}", figures


# --- 5. mixed adapters: CPU vs device -------------------------------------------------------------------


def lora_parity(ctx: CheckContext) -> Outcome:
    """8 adapters and the base model mixed in one batch: CPU fp32 and device fp32 tokens must be identical,
    and the adapters must change the tokens (else the comparison proves nothing)."""
    cpu = cpu_model(ctx.parity_preset)
    paths = ctx.adapters(cpu.config, ctx.parity_preset, NUM_ADAPTERS, PARITY_RANK)
    names = [f"a{i}" for i in range(NUM_ADAPTERS)]
    mix = [None if i % (NUM_ADAPTERS + 1) == NUM_ADAPTERS else names[i % (NUM_ADAPTERS + 1)]
           for i in range(2 * NUM_ADAPTERS)]
    prompts = bench_prompts(len(mix))
    reqs = greedy_requests(cpu.name, prompts, ctx.parity_tokens, mix)
    cores = []
    for loaded, device in ((cpu, torch.device("cpu")), (moved(cpu, ctx.device, FP32), ctx.device)):
        cores.append(ctx.engine(loaded, FP32, device=device, max_num_seqs=len(mix), max_loras=NUM_ADAPTERS,
                                max_lora_rank=PARITY_RANK))
        for name, path in zip(names, paths, strict=True):
            cores[-1].add_adapter(name, str(path))
    want, got = (run_tokens(core, reqs) for core in cores)
    base = run_tokens(cores[1], greedy_requests(cpu.name, prompts, ctx.parity_tokens))  # the device, no adapters
    changed = sum(a is not None and g != b for a, g, b in zip(mix, got, base, strict=True))
    c = compare(got, want)
    figures = {"model": cpu.name, "adapters": NUM_ADAPTERS, "rank": PARITY_RANK, "requests": len(mix),
               "base_requests": mix.count(None), "new_tokens": ctx.parity_tokens, "cpu_vs_device": c,
               "adapter_requests_unlike_base": changed}
    ok = c["identical"] and changed > 0
    return ("pass" if ok else "fail"), (f"{NUM_ADAPTERS} adapters + base, device vs CPU fp32: {_where(c)}; "
                                        f"{changed}/{len(mix) - mix.count(None)} adapter requests unlike base"), figures


# --- 6. one profiled decode step ------------------------------------------------------------------------


class _TracedAttention:
    """A model's attention backend, each layer's call inside one named profiler range (all else delegated)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def forward(self, *args, **kwargs):
        with torch.profiler.record_function(ATTN_RANGE):
            return self._inner.forward(*args, **kwargs)


def _descendants(event) -> list:
    out, stack = [], list(event.cpu_children)
    while stack:
        e = stack.pop()
        out.append(e)
        stack.extend(e.cpu_children)
    return out


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (the device's busy time)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def analyse_profile(events, wall_s: float) -> dict:
    """Kernels launched, device busy time against wall time, and what ran inside the attention ranges:
    CPU ops below each range, kernels the profiler links to them or that ran inside their device-side span."""
    cpu_type = torch.autograd.DeviceType.CPU
    ranges = [e for e in events if e.name == ATTN_RANGE and e.device_type == cpu_type]
    on_device = [e for e in events if e.device_type != cpu_type]
    marks = [e for e in on_device if e.name == ATTN_RANGE or getattr(e, "is_user_annotation", False)]
    work = [e for e in on_device if e.name != ATTN_RANGE and not getattr(e, "is_user_annotation", False)]
    kernels = [e for e in work if not e.name.startswith(("Memcpy", "Memset"))]
    attn_ops = Counter(d.name for r in ranges for d in _descendants(r))
    attn_kernels = {k.name for r in ranges for d in (r, *_descendants(r)) for k in getattr(d, "kernels", [])}
    spans = [(m.time_range.start, m.time_range.end) for m in marks if m.name == ATTN_RANGE]
    attn_kernels |= {k.name for k in kernels
                     if any(s <= k.time_range.start and k.time_range.end <= e for s, e in spans)}
    by_time = Counter()
    for k in kernels:
        by_time[k.name] += k.time_range.elapsed_us()
    top_cpu = Counter()
    for e in events:
        if e.device_type == cpu_type and e.name != ATTN_RANGE:
            top_cpu[e.name] += e.self_cpu_time_total
    gathers = sorted({n for n in attn_ops if n in GATHER_OPS} | {n for n in attn_kernels if GATHER_KERNEL.search(n)})
    busy_s = _union_us([(e.time_range.start, e.time_range.end) for e in work]) / 1e6
    return {
        "wall_ms": round(wall_s * 1e3, 3), "device_busy_ms": round(busy_s * 1e3, 3),
        "device_busy_fraction": round(busy_s / wall_s, 3) if on_device else None,
        "kernels": len(kernels), "memcpy_memset": len(work) - len(kernels),
        "cpu_ops": sum(1 for e in events if e.device_type == cpu_type),
        "attention_ranges": len(ranges), "attention_cpu_ops": dict(attn_ops.most_common(12)),
        "attention_kernels": sorted(attn_kernels), "gathers_in_attention": gathers,
        "top_kernels_us": {n: round(t, 1) for n, t in by_time.most_common(10)},
        "top_cpu_ops_us": {n: round(t, 1) for n, t in top_cpu.most_common(10)},
    }


def profile_decode(ctx: CheckContext, preset: str, backend: str | None = None) -> dict:
    """Fills a batch, runs two all-decode steps as warm-up (kernels compiled for the shapes that follow),
    profiles the next and times the one after; the requests are then aborted (at most two prefill steps and
    four decodes: 8 tokens each are enough). backend: the attention backend (default ctx.traced_backend)."""
    dtype, batch = ctx.perf_dtype, ctx.batch
    loaded = ctx.model(preset, dtype)
    core = ctx.engine(loaded, dtype, attention_backend=backend or ctx.traced_backend)
    model = core.runner.model
    model.attention = _TracedAttention(model.attention)
    for r in greedy_requests(loaded.name, bench_prompts(batch), 8, tag="p"):
        core.add(core.prepare(r))
    while any(not r.output_ids for r in core.requests.values()):  # prefill (chunked) until every row decodes
        core.step()
    core.step()
    core.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    roofline.sync(ctx.device)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        rows = len(core.step())
        roofline.sync(ctx.device)
        wall = time.perf_counter() - t0
    t0 = roofline.clock(ctx.device)
    core.step()
    plain = roofline.clock(ctx.device) - t0
    for rid in list(core.requests):
        core.abort(rid)
    figures = analyse_profile(prof.events(), wall)
    figures.update(model=loaded.name, dtype=roofline.dtype_name(dtype), decode_rows=rows,
                   layers=loaded.config.num_layers, attention_backend=model.attention.name,
                   step_ms_unprofiled=round(plain * 1e3, 3))
    return figures


def profile(ctx: CheckContext) -> Outcome:
    """One decode step at batch 64 per shape: launches, busy time, and no gather inside attention (in place)."""
    figures, problems, notes = {}, [], []
    for preset in ctx.perf_presets:
        if preset != ctx.perf_presets[0] and ctx.time_left() < 60:
            figures[preset] = {"skipped": "time budget"}
            continue
        f = figures[preset] = profile_decode(ctx, preset)
        if f["gathers_in_attention"]:
            problems.append(f"{preset}: {', '.join(f['gathers_in_attention'])} inside attention")
        if f["attention_ranges"] == 0:
            if ctx.cuda:
                problems.append(f"{preset}: attention not traced")
            notes.append(f"{preset}: attention inside the fused CPU step, not traced")
        busy = f["device_busy_fraction"]
        launched = (f"{f['kernels']} kernels, GPU busy {busy:.0%} of" if busy is not None
                    else f"{f['cpu_ops']} CPU ops in")
        notes.append(f"{preset} b{f['decode_rows']} ({f['attention_backend']}): {launched} {f['wall_ms']:.1f} ms, "
                     f"{f['attention_ranges']} attention calls, {len(f['gathers_in_attention'])} gathers in them")
    if ctx.cuda and any(f.get("attention_backend") not in (None, "triton_paged") for f in figures.values()):
        problems.append("attention backend is not triton_paged")
    return ("fail" if problems else "pass"), "; ".join(problems + notes), figures


# --- 7. decode throughput against HF and the roofline ------------------------------------------------


def measure_roofline(ctx: CheckContext) -> dict:
    """roofline.measure on the device; in --quick mode smaller buffers (a figure of the same kind, fast)."""
    if not ctx.quick:
        return roofline.measure(ctx.device, ctx.perf_dtype)
    return {"mem_read_gbs": round(roofline.mem_read_gbs(64 << 20, device=ctx.device), 2),
            "gemm_gflops": round(roofline.gemm_gflops(512, ctx.perf_dtype, device=ctx.device), 1)}


def roofline_tok_s(roof: dict, loaded: LoadedModel, weight_bytes: int, batch: int, context: int) -> float:
    """Bound on tok/s at `batch`: every step reads the weights once (memory) and does batch tokens' FLOPs."""
    memory = roof["mem_read_gbs"] * 1e9 / weight_bytes * batch
    compute = roof["gemm_gflops"] * 1e9 / flops_per_token(loaded.config, context)
    return round(min(memory, compute), 2)


def throughput_one(ctx: CheckContext, preset: str, roof: dict) -> dict:
    """Our engine and HF generate, batch 1 and batch N, rounds taking turns; best round of each."""
    dtype, n = ctx.perf_dtype, ctx.batch
    loaded = ctx.model(preset, dtype)
    core = ctx.engine(loaded, dtype)
    hf = hf_model(loaded) if ctx.with_hf else None
    tok = loaded.tokenizer
    sets = {"batch1": (bench_prompts(1), 1), f"batch{n}": (bench_prompts(n), n)}
    runs = {}
    for key, (prompts, b) in sets.items():
        _ours(core, prompts, 4, b, loaded.name)  # warm-up: prefill and decode kernels at this batch compiled
        runs[f"{key}.ours"] = lambda p=prompts, b=b: _ours(core, p, ctx.new_tokens, b, loaded.name)
        if hf is not None:
            _hf(hf, tok, prompts, 4, b)
            runs[f"{key}.hf"] = lambda p=prompts, b=b: _hf(hf, tok, p, ctx.new_tokens, b)
    rounds = interleaved_rounds(ctx.rounds, runs)
    weight_bytes = core.runner.model.weight_bytes()
    out = {"model": loaded.name, "weight_bytes": weight_bytes, "rounds": rounds}
    for key, (prompts, b) in sets.items():
        context = int(sum(len(tok.encode(p)) for p in prompts) / len(prompts) + ctx.new_tokens / 2)
        r = out[key] = {"ours_tok_s": max(rounds[f"{key}.ours"]),
                        "roofline_tok_s": roofline_tok_s(roof, loaded, weight_bytes, b, context)}
        r["fraction_of_roofline"] = round(r["ours_tok_s"] / r["roofline_tok_s"], 3)
        if hf is not None:
            r["hf_tok_s"] = max(rounds[f"{key}.hf"])
            r["speedup_vs_hf"] = round(r["ours_tok_s"] / r["hf_tok_s"], 2)
    return out


def throughput(ctx: CheckContext) -> Outcome:
    """Decode tok/s per shape at batch 1 and N against HF on the same device; target llama3-8b b64 >= 3x HF."""
    roof = measure_roofline(ctx)
    figures = {"dtype": roofline.dtype_name(ctx.perf_dtype), "new_tokens": ctx.new_tokens, "rounds": ctx.rounds,
               "measure": "generated tokens / wall time of whole runs (prefill included), best round; roofline "
                          "min(read bandwidth / weight bytes x batch, GEMM rate / FLOPs per token)",
               "roofline": roof, "hf": ctx.with_hf}
    parts = []
    for preset in ctx.perf_presets:
        if preset != ctx.perf_presets[0] and ctx.time_left() < 120:
            figures[preset] = {"skipped": "time budget"}
            parts.append(f"{preset} skipped (time)")
            continue
        f = figures[preset] = throughput_one(ctx, preset, roof)
        for key in ("batch1", f"batch{ctx.batch}"):
            r = f[key]
            vs = f" ({r['speedup_vs_hf']}x HF)" if "speedup_vs_hf" in r else ""
            parts.append(f"{preset} {key} {r['ours_tok_s']:.0f} tok/s{vs}, {r['fraction_of_roofline']:.0%} roof")
        ctx.free()
    target = figures.get("llama3-8b", {}).get("batch64", {}).get("speedup_vs_hf")
    if ctx.cuda and not ctx.quick:
        figures["target"] = {"speedup_vs_hf_min": SPEEDUP_TARGET, "llama3_8b_batch64": target}
        status = "pass" if target is not None and target >= SPEEDUP_TARGET else "fail"
        got = "not measured" if target is None else f"{target}x"
        parts.append(f"target llama3-8b b64 >= {SPEEDUP_TARGET}x HF: {got}")
    else:
        measured = [figures[p][k]["ours_tok_s"] for p in ctx.perf_presets if "skipped" not in figures[p]
                    for k in ("batch1", f"batch{ctx.batch}")]
        status = "pass" if measured and all(t > 0 for t in measured) else "fail"
    return status, "; ".join(parts), figures


# --- 8. LoRA throughput -----------------------------------------------------------------------------


def lora_throughput(ctx: CheckContext) -> Outcome:
    """tok/s of one batch with no adapter, one adapter for all, and 8 adapters mixed, on one engine (the
    largest shape; the smallest when under two minutes of the budget are left)."""
    preset = ctx.perf_presets[-1] if ctx.time_left() > 120 else ctx.perf_presets[0]
    dtype, n = ctx.perf_dtype, ctx.lora_batch
    loaded = ctx.model(preset, dtype)
    paths = ctx.adapters(loaded.config, preset, NUM_ADAPTERS, PERF_RANK)
    core = ctx.engine(loaded, dtype, max_loras=NUM_ADAPTERS, max_lora_rank=PERF_RANK)
    for i, path in enumerate(paths):
        core.add_adapter(f"a{i}", str(path))
    prompts = bench_prompts(n)
    patterns = {"base": None, "identical": ["a0"] * n, "distinct": [f"a{i % NUM_ADAPTERS}" for i in range(n)]}
    for name, adapters in patterns.items():  # warm-up: slots loaded, kernels compiled
        run_tokens(core, greedy_requests(loaded.name, prompts, 4, adapters, tag=f"w{name}"))
    runs = {name: lambda a=adapters, name=name: _tok_s(core, greedy_requests(loaded.name, prompts, ctx.new_tokens, a,
                                                                             tag=name))
            for name, adapters in patterns.items()}
    rounds = interleaved_rounds(ctx.rounds, runs)
    best = {name: max(r) for name, r in rounds.items()}
    figures = {"model": loaded.name, "dtype": roofline.dtype_name(dtype), "batch": n, "adapters": NUM_ADAPTERS,
               "rank": PERF_RANK, "new_tokens": ctx.new_tokens, "rounds": rounds,
               **{f"{name}_tok_s": t for name, t in best.items()},
               "ratios": {f"{name}_vs_base": round(best[name] / best["base"], 3) for name in ("identical", "distinct")}}
    r = figures["ratios"]
    summary = (f"{preset} b{n}: base {best['base']:.0f} tok/s, identical {r['identical_vs_base']:.2f}x, "
               f"{NUM_ADAPTERS} adapters {r['distinct_vs_base']:.2f}x of base")
    return ("pass" if all(t > 0 for t in best.values()) else "fail"), summary, figures
