"""gpu-check's engine-path steps (10-13): decode step time with CUDA graphs on and off, a sampled batch on the
device, an adapter read while a batch decodes, and the KV cache sized by measurement on the real card.

Every step takes the run's CheckContext (gpu_check.py) and returns (status, one-line summary, figures), as
gpu_check_steps does. Step times are per `EngineCore.step()`, the device synchronised at both ends. Targets
are judged on CUDA in a full run only; on the CPU (--quick) the steps report figures and check correctness.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from loraplex.cli.bench import roofline
from loraplex.cli.bench.engine import bench_prompts, interleaved_rounds
from loraplex.cli.bench.gpu_check import PROMPT_TOKENS_MAX
from loraplex.cli.bench.gpu_check_steps import (
    FP32,
    PERF_RANK,
    _tok_s,
    _where,
    compare,
    greedy_requests,
    run_tokens,
)
from loraplex.cli.bench.percentiles import percentile
from loraplex.cli.bench.synthetic_adapters import write_adapter
from loraplex.engine.api import GenerateEvent, GenerateRequest, SamplingParams
from loraplex.engine.core import EngineCore
from loraplex.engine.lora.peft import files_version
from loraplex.engine.memory import DEFAULT_KV_CACHE_BYTES, MIB
from loraplex.engine.static_decode import static_decode_mode

if TYPE_CHECKING:
    from loraplex.cli.bench.gpu_check import CheckContext

Outcome = tuple[str, str, dict]
BLOCK = 16
WARMUP_STEPS = 3  # untimed decode steps before any timed one (kernels compiled, graphs replayed once)
GRAPH_STEP_TARGET_MS = 2.0  # small shape, bf16, batch 1, CUDA graphs: median step time at most this
LOAD_BATCH = 32  # requests decoding while an adapter is read
LOAD_P99_MAX_RATIO = 1.5  # their step-time p99 during the read, against a run without it
MEMORY_SLACK = 0.02  # of the utilization budget: allocator rounding


# --- shared helpers ---------------------------------------------------------------------------------


def ms_stats(times_ms: list[float]) -> dict:
    """Median, p90, p99, min and max of step times (ms), and how many."""
    return {"steps": len(times_ms), "median_ms": round(percentile(times_ms, 50), 3),
            "p90_ms": round(percentile(times_ms, 90), 3), "p99_ms": round(percentile(times_ms, 99), 3),
            "min_ms": round(min(times_ms), 3), "max_ms": round(max(times_ms), 3)}


def kv_blocks_for(seqs: int, new_tokens: int) -> int:
    """KV blocks for `seqs` requests of bench_prompts() and `new_tokens` tokens each (no preemption)."""
    return seqs * -(-(PROMPT_TOKENS_MAX + new_tokens + BLOCK) // BLOCK)


def collect(events: list[GenerateEvent], tokens: dict[str, list[int]]) -> None:
    """Appends each event's token ids to its request's list (requests not in `tokens` are ignored)."""
    for ev in events:
        if ev.request_id in tokens:
            tokens[ev.request_id].extend(ev.token_ids)


def admit(core: EngineCore, requests: list[GenerateRequest], tokens: dict[str, list[int]]) -> None:
    """Queues the requests; their tokens will be collected into `tokens`."""
    for r in requests:
        core.add(core.prepare(r))
        tokens[r.request_id] = []


def fill(core: EngineCore, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    """Admits the requests and steps until each has its first token (prefills done): every later step is
    an all-decode step of the batch. Returns the tokens so far, by request id."""
    tokens: dict[str, list[int]] = {}
    admit(core, requests, tokens)
    while any(not tokens[r.request_id] for r in requests):
        collect(core.step(), tokens)
    return tokens


def timed_step(core: EngineCore, tokens: dict[str, list[int]]) -> float:
    """One engine step in ms of wall time; its tokens collected. The device is not synchronised per step
    (that would undo asynchronous scheduling): steps in a row pace each other, as each waits for the
    tokens of its own or the previous step."""
    t0 = time.perf_counter()
    events = core.step()
    ms = (time.perf_counter() - t0) * 1e3
    collect(events, tokens)
    return ms


def abort_all(core: EngineCore, tokens: dict[str, list[int]] | None = None) -> None:
    """Ends every request, after collecting into `tokens` those of the step still in flight."""
    collect(core.drain(), tokens if tokens is not None else {})
    for rid in list(core.requests):
        core.abort(rid)


def decode_times(core: EngineCore, model: str, batch: int, steps: int, tag: str,
                 warmup: int = WARMUP_STEPS) -> tuple[list[float], list]:
    """Step times (ms) of `steps` all-decode steps at `batch` greedy requests after `warmup` untimed ones, and
    every request's tokens (its first included); the requests are aborted after."""
    reqs = greedy_requests(model, bench_prompts(batch), warmup + steps + 2, tag=tag)
    tokens = fill(core, reqs)
    for _ in range(warmup):
        timed_step(core, tokens)
    times = [timed_step(core, tokens) for _ in range(steps)]
    abort_all(core, tokens)
    # (with asynchronous scheduling one more step was in flight: the same first tokens are compared)
    return times, [tokens[r.request_id][:1 + warmup + steps] for r in reqs]


# --- 9. CUDA graphs on and off ----------------------------------------------------------------------


def graph_modes(ctx: CheckContext, preset: str, dtype: torch.dtype, batches: tuple[int, ...], steps: int,
                warmup: int, figures: dict) -> dict:
    """Decode step times at each batch with cuda_graphs off, then on, then on without asynchronous scheduling
    (into figures["batch<b>"] as graphs_off, graphs_on, graphs_on_sync), and the backend and static decode mode
    of each; returns every run's tokens by (mode, batch)."""
    loaded = ctx.model(preset, dtype)
    # --quick: a short context (the interpreted decode kernels' grid grows with its split count)
    short = {"max_model_len": PROMPT_TOKENS_MAX + 2 * BLOCK} if ctx.quick else {}
    tokens = {}
    for mode, graphs_setting, scheduling in (("off", "off", "on"), ("on", "on", "on"), ("on_sync", "on", "off")):
        core = ctx.engine(loaded, dtype, max_num_seqs=max(batches), cuda_graphs=graphs_setting,
                          async_scheduling=scheduling,
                          attention_backend=ctx.traced_backend,  # (on the CPU: triton_paged, interpreted)
                          num_kv_blocks=kv_blocks_for(max(batches), warmup + steps + 2), **short)
        backend = figures["attention_backend"] = core.runner.model.attention.name
        figures["static_decode"][mode] = static_decode_mode(graphs_setting, ctx.device, backend)
        for b in batches:
            times, tokens[mode, b] = decode_times(core, loaded.name, b, steps, f"g{mode}{b}", warmup)
            figures.setdefault(f"batch{b}", {})[f"graphs_{mode}"] = ms_stats(times)
        del core
        ctx.free()
    return tokens


def graphs(ctx: CheckContext) -> Outcome:
    """Decode step time at batch 1 and N with cuda_graphs off and on (on the CPU "on" runs the static
    step eagerly); greedy tokens must be identical in fp32 (in bf16 where timed, reported; on CUDA an fp32
    pair at batch N checks); target on CUDA: small b1 with graphs <= 2 ms."""
    preset, dtype = ctx.parity_preset, ctx.perf_dtype
    batches, steps, warmup = ((1, 2), 2, 1) if ctx.quick else ((1, 64), 48, WARMUP_STEPS)
    figures: dict = {"model": f"synthetic:{preset}", "dtype": roofline.dtype_name(dtype), "timed_steps": steps,
                     "measure": "ms of wall time per all-decode engine step in a run of steps; median and p90",
                     "static_decode": {}}
    tokens = graph_modes(ctx, preset, dtype, batches, steps, warmup, figures)
    parts, checked = [], []
    for b in batches:
        f = figures[f"batch{b}"]
        c = f["on_vs_off_tokens"] = compare(tokens["on", b], tokens["off", b])
        sync = f["async_vs_sync_tokens"] = compare(tokens["on", b], tokens["on_sync", b])
        f["speedup"] = round(f["graphs_off"]["median_ms"] / f["graphs_on"]["median_ms"], 2)
        f["async_speedup"] = round(f["graphs_on_sync"]["median_ms"] / f["graphs_on"]["median_ms"], 2)
        parts.append(f"b{b} {f['graphs_off']['median_ms']:.2f} -> {f['graphs_on']['median_ms']:.2f} ms "
                     f"({f['speedup']}x; {f['async_speedup']}x of it from async scheduling), tokens {_where(c)}")
        checked += [c, sync]
    if dtype != FP32:  # bf16 may part at a near-tie: the static path's identity is checked in fp32
        fp32: dict = {"static_decode": {}}
        t32 = graph_modes(ctx, preset, FP32, batches[-1:], 16, warmup, fp32)
        checked = [compare(t32["on", batches[-1]], t32["off", batches[-1]])]
        figures["fp32_on_vs_off_tokens"] = checked[0]
        parts.append(f"fp32 b{batches[-1]} tokens {_where(checked[0])}")
    static = figures["static_decode"]["on"]
    ok = all(c["identical"] for c in checked) and (static == "graphs" or not ctx.cuda)
    if static is None:
        parts.append(f"static decode not used with {figures['attention_backend']}")
    if ctx.cuda and not ctx.quick:
        got = figures["batch1"]["graphs_on"]["median_ms"]
        figures["target"] = {"small_batch1_graphs_on_max_ms": GRAPH_STEP_TARGET_MS, "got_ms": got}
        ok &= got <= GRAPH_STEP_TARGET_MS
        parts.append(f"target b1 <= {GRAPH_STEP_TARGET_MS} ms: {got:.2f} ms")
    return ("pass" if ok else "fail"), f"{preset} off -> on ({static}): " + "; ".join(parts), figures


# --- 10. a sampled batch ----------------------------------------------------------------------------


def sampled_requests(model: str, prompts: list[str], new_tokens: int, seeded: set[int]) -> list[GenerateRequest]:
    """Sampled requests (temperature 0.8, top-p 0.9, top-k 50, min-p 0.05), those in `seeded` with a seed."""
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=new_tokens, temperature=0.8, top_p=0.9, top_k=50, min_p=0.05,
                              seed=1000 + i if i in seeded else None, ignore_eos=True)

    return [GenerateRequest(f"s{i}", model, prompt=p, sampling=params(i)) for i, p in enumerate(prompts)]


def seeded_vs_alone(core: EngineCore, reqs: list[GenerateRequest], seeded: list[int],
                    batched: list[list[int]] | None = None) -> dict:
    """The seeded requests' tokens in the whole batch (`batched` when already run) against each run alone."""
    batched = batched or run_tokens(core, reqs)
    return compare([batched[i] for i in seeded], [run_tokens(core, [reqs[i]])[0] for i in seeded])


def sampled(ctx: CheckContext) -> Outcome:
    """A batch of sampled requests: tok/s against the same batch greedy; the seeded ones must give the
    same tokens alone as in the batch (sampling independent of the batch's composition)."""
    preset, dtype = ctx.parity_preset, ctx.perf_dtype
    n = 8 if ctx.quick else 64
    seeded = set(range(1, n, max(4, n // 4)))
    loaded = ctx.model(preset, dtype)
    core = ctx.engine(loaded, dtype, max_num_seqs=n, num_kv_blocks=kv_blocks_for(n, ctx.new_tokens))
    prompts = bench_prompts(n)
    greedy = run_tokens(core, greedy_requests(loaded.name, prompts, ctx.new_tokens))  # (warm-up too)
    reqs = sampled_requests(loaded.name, prompts, ctx.new_tokens, seeded)
    batched = run_tokens(core, reqs)
    runs = {"greedy": lambda: _tok_s(core, greedy_requests(loaded.name, prompts, ctx.new_tokens)),
            "sampled": lambda: _tok_s(core, sampled_requests(loaded.name, prompts, ctx.new_tokens, seeded))}
    rounds = interleaved_rounds(ctx.rounds, runs)
    order = sorted(seeded)
    c = seeded_vs_alone(core, reqs, order, batched)
    unlike = sum(b != g for b, g in zip(batched, greedy, strict=True))
    best = {name: max(r) for name, r in rounds.items()}
    figures = {"model": loaded.name, "dtype": roofline.dtype_name(dtype), "batch": n, "seeded": order,
               "new_tokens": ctx.new_tokens, "sampling": {"temperature": 0.8, "top_p": 0.9, "top_k": 50,
                                                          "min_p": 0.05},
               "rounds": rounds, "greedy_tok_s": best["greedy"], "sampled_tok_s": best["sampled"],
               "sampled_vs_greedy": round(best["sampled"] / best["greedy"], 3), "seeded_batch_vs_alone": c,
               "seeded_check_dtype": roofline.dtype_name(dtype), "sampled_unlike_greedy": unlike}
    if dtype != FP32:  # a bf16 logit may differ by batch size: the sampler's independence is checked in fp32
        del core
        ctx.free()
        figures[f"seeded_batch_vs_alone_{roofline.dtype_name(dtype)}"] = c
        core = ctx.engine(ctx.model(preset, FP32), FP32, max_num_seqs=n, num_kv_blocks=kv_blocks_for(n, ctx.new_tokens))
        c = figures["seeded_batch_vs_alone"] = seeded_vs_alone(core, reqs, order)
        figures["seeded_check_dtype"] = "float32"
    ok = c["identical"] and unlike > 0 and min(best.values()) > 0
    summary = (f"{preset} b{n}: sampled {best['sampled']:.0f} tok/s = {figures['sampled_vs_greedy']:.2f}x greedy; "
               f"{len(order)} seeded batch vs alone: {_where(c)}; {unlike}/{n} unlike greedy")
    return ("pass" if ok else "fail"), summary, figures


# --- 11. an adapter read while a batch decodes -------------------------------------------------------


def load_run(core: EngineCore, model: str, adapter: str, steps_before: int, steps_after: int,
             max_tokens: int) -> dict:
    """LOAD_BATCH base requests decode; after `steps_before` timed steps a request for `adapter` arrives;
    steps go on until its first token, then `steps_after` more. Returns the step times (ms), the arrival's
    and first token's step indices (the window is [arrival, first)) and the steps begun while it was read."""
    prompts = bench_prompts(LOAD_BATCH + 1)
    tokens = fill(core, greedy_requests(model, prompts[:LOAD_BATCH], max_tokens, tag="d"))
    for _ in range(WARMUP_STEPS):
        timed_step(core, tokens)
    times = [timed_step(core, tokens) for _ in range(steps_before)]
    newcomer = greedy_requests(model, prompts[LOAD_BATCH:], 4, [adapter], tag=f"new-{adapter}")
    admit(core, newcomer, tokens)
    arrival, reading = len(times), 0
    while not tokens[newcomer[0].request_id]:
        if len(times) - arrival > max_tokens - WARMUP_STEPS - steps_before - steps_after - 2:
            raise RuntimeError(f"adapter {adapter!r}: no first token {len(times) - arrival} steps after admission")
        reading += core.lora.loading(adapter)
        times.append(timed_step(core, tokens))
    first = len(times)
    times += [timed_step(core, tokens) for _ in range(steps_after)]
    abort_all(core)
    return {"times": times, "arrival": arrival, "first_token": first, "steps_while_reading": reading}


def adapter_load(ctx: CheckContext) -> Outcome:
    """32 requests decode while a request's adapter, registered unread (as a pool reload does), is read:
    their step-time p99 from its admission to its first token against the same steps of a run whose
    newcomer's adapter is already in a slot; target on CUDA: at most 1.5x."""
    preset, dtype = ctx.parity_preset, ctx.perf_dtype
    loaded = ctx.model(preset, dtype)
    before, after = (4, 4) if ctx.quick else (16, 16)
    max_tokens = 64 if ctx.quick else 256
    core = ctx.engine(loaded, dtype, max_num_seqs=LOAD_BATCH + 1, max_loras=2, max_lora_rank=PERF_RANK,
                      num_kv_blocks=kv_blocks_for(LOAD_BATCH + 1, max_tokens))
    core.add_adapter("warm", str(ctx.adapters(loaded.config, preset, 1, PERF_RANK)[0]))
    fresh = write_adapter(ctx.work_dir / f"fresh-{preset}", loaded.config, rank=PERF_RANK, seed=900)
    core.add_adapter("fresh", str(fresh), files_version(fresh))  # nothing read until a request asks
    load_run(core, loaded.name, "warm", before, after, max_tokens)  # warm-up: "warm" in a slot, shapes compiled
    loads_before = core.lora.stats.disk_loads
    load = load_run(core, loaded.name, "fresh", before, after, max_tokens)
    width = load["first_token"] - load["arrival"]
    # the control runs at least as many steps after its arrival as the read's window took
    control = load_run(core, loaded.name, "warm", before, max(after, width), max_tokens)
    windows = {"load": load["times"][load["arrival"]:load["first_token"]],
               "without": control["times"][control["arrival"]:control["arrival"] + width]}
    p99 = {k: round(percentile(w, 99), 3) for k, w in windows.items()}
    ratio = round(p99["load"] / p99["without"], 3)
    figures = {"model": loaded.name, "dtype": roofline.dtype_name(dtype), "decoding": LOAD_BATCH,
               "rank": PERF_RANK, "window_steps": width, "steps_while_reading": load["steps_while_reading"],
               "adapter_read_from_disk": core.lora.stats.disk_loads - loads_before,
               "p99_ms_during_load": p99["load"], "p99_ms_without": p99["without"], "p99_ratio": ratio,
               "window_ms": {k: [round(t, 3) for t in w] for k, w in windows.items()},
               "run_with_load": ms_stats(load["times"]), "run_without": ms_stats(control["times"]),
               "measure": "step times from the newcomer's admission to its first token; the run without: the "
                          "same steps with its adapter already in a slot"}
    summary = (f"{preset} b{LOAD_BATCH}: window {width} steps ({load['steps_while_reading']} while reading), "
               f"p99 {p99['load']:.2f} ms during load vs {p99['without']:.2f} ms without ({ratio}x)")
    ok = figures["adapter_read_from_disk"] == 1 and min(p99.values()) > 0
    if ctx.cuda and not ctx.quick:
        figures["target"] = {"p99_ratio_max": LOAD_P99_MAX_RATIO, "got": ratio}
        ok &= ratio <= LOAD_P99_MAX_RATIO
        summary += f"; target <= {LOAD_P99_MAX_RATIO}x"
    return ("pass" if ok else "fail"), summary, figures


# --- 12. memory sizing --------------------------------------------------------------------------------


def max_step(core: EngineCore) -> dict:
    """One step of max_num_batched_tokens prompt tokens (at most the context length) with log-probabilities
    for each (the logits of every token: what the sizing profiled), one new token. Returns its figures."""
    n = min(core.config.max_num_batched_tokens, core.max_model_len - 1)
    text = core.tokenizer.encode("the quick brown fox jumps over a lazy dog " * 8, add_special_tokens=False)
    ids = tuple((text * (n // len(text) + 1))[:n])
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    computed, steps = core.prompt_tokens_computed, core.num_steps
    t0 = roofline.clock(core.config.torch_device)
    run_tokens(core, [GenerateRequest("max-step", core.model_name, prompt_token_ids=ids, sampling=sp)])
    return {"prompt_tokens": core.prompt_tokens_computed - computed, "steps": core.num_steps - steps,
            "seconds": round(roofline.clock(core.config.torch_device) - t0, 3)}


def memory_one(ctx: CheckContext, preset: str) -> dict:
    """An engine with the default KV sizing on `preset`: its stats, the device's memory before and after,
    and a maximum-size step; on CUDA whether weights + KV + peak and the memory in use after the step stay
    within gpu_memory_utilization x total (+2%)."""
    ctx._models.clear()
    ctx.free()
    free0, total = torch.cuda.mem_get_info(ctx.device) if ctx.cuda else (0, 0)
    loaded = ctx.model(preset, ctx.perf_dtype)
    core = ctx.engine(loaded, ctx.perf_dtype, num_kv_blocks=None)  # kv_cache_bytes None: the default sizing
    s = core.stats()
    f = {"model": loaded.name, "weights": s.models.weight_bytes, "kv_cache_bytes": s.memory.kv_cache_bytes,
         "memory_budget_bytes": s.memory.budget_bytes, "peak_step_bytes": s.memory.peak_step_bytes,
         "gpu_memory_utilization": s.memory.gpu_memory_utilization, "kv_blocks": s.kv.blocks_total,
         "kv_tokens": s.kv.blocks_total * core.config.block_size,
         "max_num_batched_tokens": core.config.max_num_batched_tokens}
    if ctx.cuda:
        free1, _ = torch.cuda.mem_get_info(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        allocated = torch.cuda.memory_allocated(ctx.device)
    try:
        f["max_step"] = max_step(core)
    except torch.cuda.OutOfMemoryError as e:
        f["max_step"] = {"oom": str(e)[:300]}
    if ctx.cuda:
        free2, _ = torch.cuda.mem_get_info(ctx.device)
        limit = core.config.gpu_memory_utilization * total
        sized = f["weights"] + f["kv_cache_bytes"] + f["peak_step_bytes"]
        f.update(total=total, free_before=free0, free_after_engine=free1, free_after_step=free2,
                 step_peak_bytes=torch.cuda.max_memory_allocated(ctx.device) - allocated,
                 limit_bytes=int(limit), sized_bytes=sized, used_after_step=total - free2,
                 sized_fits=sized <= limit * (1 + MEMORY_SLACK),
                 used_fits=total - free2 <= limit * (1 + MEMORY_SLACK))
    del core
    ctx.free()
    return f


def memory(ctx: CheckContext) -> Outcome:
    """The KV cache sized by measurement on CUDA (small and llama3-8b shapes): it and a maximum-size step fit
    gpu_memory_utilization of the card; on the CPU the configured 512 MiB."""
    presets = ("small", "llama3-8b") if ctx.cuda and not ctx.quick else (ctx.parity_preset,)
    figures, parts, ok = {}, [], True
    for preset in presets:
        if preset != presets[0] and ctx.time_left() < 90:
            figures[preset] = {"skipped": "time budget"}
            parts.append(f"{preset} skipped (time)")
            continue
        f = figures[preset] = memory_one(ctx, preset)
        kv = f"KV {f['kv_cache_bytes'] / MIB:.0f} MiB ({f['kv_tokens']} tokens)"
        ran = "oom" not in f["max_step"]
        if ctx.cuda:
            fits = f["sized_fits"] and f["used_fits"]
            ok &= fits and ran
            parts.append(f"{preset}: {kv}, budget {f['memory_budget_bytes'] / MIB:.0f} MiB, step peak "
                         f"{f['peak_step_bytes'] / MIB:.0f} MiB, in use after a max step "
                         f"{f['used_after_step'] / MIB:.0f} of {f['limit_bytes'] / MIB:.0f} MiB"
                         + ("" if ran else ", max step OOM") + ("" if fits else ", over the limit"))
        else:  # the CPU keeps the configured size, in whole blocks
            per_block = f["kv_cache_bytes"] // max(1, f["kv_blocks"])
            ok &= ran and DEFAULT_KV_CACHE_BYTES - per_block < f["kv_cache_bytes"] <= DEFAULT_KV_CACHE_BYTES
            parts.append(f"{preset} (CPU, configured): {kv}, max step of {f['max_step'].get('prompt_tokens')} "
                         f"tokens {'ran' if ran else 'OOM'}")
    return ("pass" if ok else "fail"), "; ".join(parts), figures

