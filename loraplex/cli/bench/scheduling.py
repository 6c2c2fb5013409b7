"""Scheduling benchmarks, each side by side in one run.

prefix:   TTFT of requests sharing a long system prompt, prefix cache on vs off, one after another
          (the cache serves each from the first); and the n choices of one prompt arriving at once
          at a cold cache, whose prompt the cache computes once (the others wait a step for its
          blocks) and holds once.
priority: TTFT of realtime requests sent into an engine saturated by batch-class work, with
          priority classes vs the same load all `standard` (first come, first served).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

from loraplex.cli.bench.percentiles import percentile
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.models.loader import load_model, resolve_model

SYSTEM_TEXT = (
    "You are the support assistant of a large online shop. Answer politely and precisely. "
    "Orders ship within two business days; returns are accepted within thirty days when the item is unused. "
    "Customers may change the delivery address until the parcel leaves the warehouse. Gift cards never expire. "
)


def _tokens(tokenizer, text: str, n: int) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def run_prefix_bench(model: str, requests: int, system_tokens: int, question_tokens: int, choices: int,
                     choice_prompt_tokens: int) -> dict:
    loaded = load_model(resolve_model(model), torch.float32, torch.device("cpu"))
    tok = loaded.tokenizer
    system = _tokens(tok, SYSTEM_TEXT * 8, system_tokens)
    questions = [_tokens(tok, f"Question {i}: my order number {1000 + 7 * i} has not arrived, and I would like to "
                              f"know where parcel {i} is and whether I can still change the address to street {i}.",
                         question_tokens) for i in range(requests)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    results: dict = {"model": model, "requests": requests, "system_tokens": system_tokens,
                     "question_tokens": question_tokens, "choices": choices,
                     "choice_prompt_tokens": choice_prompt_tokens}
    choice_prompt = (system + questions[0])[-choice_prompt_tokens:]
    choice_sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ttft: dict[str, list[float]] = {}
    burst: dict[str, dict] = {}
    for label, caching in (("uncached", False), ("cached", True)):
        def fresh_core(caching: bool = caching) -> EngineCore:
            config = EngineConfig(model=model, device="cpu", dtype="float32", enable_prefix_caching=caching)
            core = EngineCore(config, loaded=loaded)
            core.run([GenerateRequest("warm", model, prompt_token_ids=tuple(questions[0]), sampling=sp)])
            return core

        core = fresh_core()
        ttft[label] = []
        for i, q in enumerate(questions):
            (done,) = core.run([GenerateRequest(f"{label}{i}", model, prompt_token_ids=tuple(system + q), sampling=sp)])
            ttft[label].append(done.usage.ttft_s * 1000)
        results.setdefault("cached_prompt_tokens_total", {})[label] = core.stats().kv.prefix_hit_tokens
        burst[label] = _burst(fresh_core(), model, [choice_prompt] * choices, choice_sp)
    results["ttft_ms"] = {f"{k}_p50": round(statistics.median(v), 2) for k, v in ttft.items()}
    ms = results["ttft_ms"]
    results["ratio_uncached_over_cached"] = round(ms["uncached_p50"] / ms["cached_p50"], 2)
    results["choices_at_once"] = burst
    results["choices_ratio_uncached_over_cached"] = round(burst["uncached"]["wall_ms"] / burst["cached"]["wall_ms"], 2)
    return results


def _burst(core: EngineCore, model: str, prompts: list[list[int]], sp: SamplingParams) -> dict:
    """Every prompt at once into a cold cache: wall time until all finished, TTFT p50,
    the prompt tokens the engine computed rather than took from the cache, and the most KV blocks
    they held at once."""
    hits = core.stats().kv.prefix_hit_tokens
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(GenerateRequest(f"burst{i}", model, prompt_token_ids=tuple(p), sampling=sp))
    ttft, peak_blocks = [], 0
    while core.has_work():
        ttft += [ev.usage.ttft_s * 1000 for ev in core.step() if ev.finished]
        peak_blocks = max(peak_blocks, core.stats().kv.blocks_used)
    wall = time.perf_counter() - t0
    computed = sum(len(p) for p in prompts) - (core.stats().kv.prefix_hit_tokens - hits)
    return {"wall_ms": round(wall * 1000, 1), "ttft_p50_ms": round(statistics.median(ttft), 1),
            "prompt_tokens_computed": computed, "peak_kv_blocks": peak_blocks}


async def _priority_round(engine: AsyncEngine, model: str, with_priority: bool, batch_requests: int,
                          batch_tokens: int, realtime_requests: int, interval_s: float) -> list[float]:
    batch_sp = SamplingParams(max_tokens=batch_tokens, temperature=0.0, ignore_eos=True)
    rt_sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tag = "p" if with_priority else "f"

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    async def realtime(i: int) -> float:
        req = GenerateRequest(f"{tag}-rt{i}", model, prompt=f"Quick question {i}: what time is it?", sampling=rt_sp,
                              priority="realtime" if with_priority else "standard")
        t0 = time.perf_counter()
        stream = engine.generate(await engine.prepare(req))  # (as the platform submits it)
        first = await stream.__anext__()
        ttft = time.perf_counter() - t0
        if not first.finished:
            await drain(stream)
        return ttft * 1000

    background = [asyncio.ensure_future(drain(engine.generate(GenerateRequest(
        f"{tag}-b{i}", model, prompt=f"Write a long report on topic {i}.", sampling=batch_sp,
        priority="batch" if with_priority else "standard")))) for i in range(batch_requests)]
    await asyncio.sleep(interval_s)
    probes = []
    for i in range(realtime_requests):
        probes.append(asyncio.ensure_future(realtime(i)))
        await asyncio.sleep(interval_s)
    ttfts = await asyncio.gather(*probes)
    await asyncio.gather(*background)
    return list(ttfts)


def run_priority_bench(model: str, max_num_seqs: int, batch_tokens: int, realtime_requests: int,
                       interval: float) -> dict:
    loaded = load_model(resolve_model(model), torch.float32, torch.device("cpu"))
    results: dict = {"model": model, "max_num_seqs": max_num_seqs, "batch_requests": 2 * max_num_seqs,
                     "batch_tokens": batch_tokens, "realtime_requests": realtime_requests, "interval_s": interval,
                     "realtime_ttft_ms": {}}
    for label, with_priority in (("fcfs", False), ("with_priority", True)):
        engine = AsyncEngine(EngineCore(EngineConfig(model=model, device="cpu", dtype="float32",
                                                     max_num_seqs=max_num_seqs), loaded=loaded))
        try:
            ttfts = asyncio.run(_priority_round(engine, model, with_priority, 2 * max_num_seqs, batch_tokens,
                                                realtime_requests, interval))
            stats = engine.stats()
        finally:
            engine.shutdown()
        results["realtime_ttft_ms"][f"{label}_p50"] = round(statistics.median(ttfts), 1)
        results["realtime_ttft_ms"][f"{label}_p99"] = round(percentile(ttfts, 99), 1)
        results[f"{label}_preemptions"] = stats.requests.preemptions_by_class
    r = results["realtime_ttft_ms"]
    results["ratio_p99_priority_over_fcfs"] = round(r["with_priority_p99"] / r["fcfs_p99"], 3)
    return results
