"""Multi-model multiplexing: load times per tier, and the cost of alternating between two
resident models against serving one, in one run.

load_ms.first     register the default model from its GGUF with an empty cache (dequantize, write the
                  safetensors cache) and load it onto the device
load_ms.disk      load from the safetensors cache (memory-mapped) onto the device
load_ms.cpu_tier  load from weights kept in host memory onto the device
alternating.tok_s requests one after another, alternating between the default model and a synthetic
                  model of the same shape, both resident; single.tok_s the same requests on one model
"""

from __future__ import annotations

import os
import tempfile
import time

from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.pool import ModelPool

DEFAULT = "smollm2-135m"
TWIN = "synthetic:small"  # SmolLM2-135M's shape with random weights


def _timed_load(pool: ModelPool, name: str) -> float:
    t0 = time.perf_counter()
    pool.load(name)
    return (time.perf_counter() - t0) * 1000


def _serve(pool: ModelPool, models: list[str], new_tokens: int) -> float:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    generated = 0
    for i, model in enumerate(models):
        entry, prepared = pool.prepare(GenerateRequest(f"{model}-{i}-{time.monotonic_ns()}", model,
                                                       prompt=f"Tell me about topic number {i}.", sampling=sp))
        pool.submit(entry, prepared)
        done = False
        while not done:
            for e in pool.step():
                generated += len(e.token_ids)
                done = done or e.finished
    return generated / (time.perf_counter() - t0)


def run_multiplex_bench(requests: int, new_tokens: int) -> dict:
    config = EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=64 << 20)
    results: dict = {"models": [DEFAULT, TWIN], "requests": requests, "new_tokens": new_tokens, "load_ms": {}}
    old_cache = os.environ.get("LORAPLEX_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["LORAPLEX_CACHE_DIR"] = cache
        try:
            pool = ModelPool(memory_budget=0.5, cpu_budget_bytes=0, device="cpu")  # no CPU tier yet
            t0 = time.perf_counter()
            pool.register_model(DEFAULT, config=config)
            pool.load(DEFAULT)
            results["load_ms"]["first"] = round((time.perf_counter() - t0) * 1000, 1)
            pool.unload(DEFAULT)  # no CPU tier: back to disk (the safetensors cache)
            results["load_ms"]["disk"] = round(_timed_load(pool, DEFAULT), 1)
            pool.cpu_budget = 4 << 30
            pool.unload(DEFAULT)  # now kept in host memory
            assert pool.models[DEFAULT].tier == "cpu"
            results["load_ms"]["cpu_tier"] = round(_timed_load(pool, DEFAULT), 1)
            pool.register_model(TWIN, config=config)
            pool.load(TWIN)
            _serve(pool, [DEFAULT, TWIN], 4)  # warm-up
            results["single"] = {"tok_s": round(_serve(pool, [DEFAULT] * requests, new_tokens), 2)}
            alternating = [DEFAULT if i % 2 == 0 else TWIN for i in range(requests)]
            results["alternating"] = {"tok_s": round(_serve(pool, alternating, new_tokens), 2)}
            results["tiers_at_end"] = {n: s["tier"] for n, s in pool.stats().items()}
            pool.shutdown()
        finally:
            if old_cache is None:
                os.environ.pop("LORAPLEX_CACHE_DIR", None)
            else:
                os.environ["LORAPLEX_CACHE_DIR"] = old_cache
    results["ratio_alternating_over_single"] = round(results["alternating"]["tok_s"] / results["single"]["tok_s"], 3)
    return results
