"""KV cache dtypes against an fp32 cache under the same fp32 model (EngineConfig.kv_cache_dtype), in one run.

One engine per cache dtype, all on the same loaded weights, take turns step by step (step_interleaved) over
the same greedy requests at each batch size. Reported per batch: each engine's tokens/s (the harmonic mean of
its rounds), its ratio to the fp32 cache's (and the median of the per-round ratios), and how far its greedy
tokens follow the fp32 cache's: agreement (lora.agreement: whole requests alike, tokens before the first
difference) and the share of positions alike; and, teacher-forced, the share of the fp32 outputs' positions
where each engine's most likely next token is fp32's (next_token_agreement). A decode step reads every
context token's K/V once, so the cache's width matters most at large batches and long contexts: the
decode-step figures time each engine's all-decode step alone at the largest batch and set contexts
(decode_step_tok_s), free of prefill and of the short bench prompts. Quality: each engine's perplexity over
the bench prompts (prompt log-probabilities) and its KV block bytes.
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from loraplex.cli.bench.engine import bench_prompts, paired_ratio, step_interleaved
from loraplex.cli.bench.lora import agreement
from loraplex.cli.bench.quant import _requests, prompt_perplexity
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import KV_CACHE_DTYPES, EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.kv.kv_dtype import quantize, raw
from loraplex.engine.memory import block_bytes
from loraplex.engine.models.loader import load_model, resolve_model

BASE = "float32"


def _sizes(batches: str) -> list[int]:
    try:
        sizes = sorted({int(b) for b in batches.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batches: positive batch sizes, comma-separated, got {batches!r}")
    return sizes


def _dtypes(names: str) -> list[str]:
    dtypes = [BASE] + [d for d in dict.fromkeys(names.split(",")) if d != BASE]
    unknown = [d for d in dtypes if d not in KV_CACHE_DTYPES]
    if unknown:
        raise ValueError(f"--kv-cache-dtypes: {', '.join(unknown)} (have: {', '.join(KV_CACHE_DTYPES)})")
    return dtypes


def positions_alike(got: dict[str, list[int]], want: dict[str, list[int]]) -> float | None:
    """The share of output positions where `got` has `want`'s token (after a first difference, too)."""
    pairs = [(a, b) for rid, w in want.items() for a, b in zip(got.get(rid, []), w, strict=False)]
    total = sum(len(w) for w in want.values())
    return round(sum(a == b for a, b in pairs) / total, 4) if total else None


def next_token_agreement(core: EngineCore, model: str, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Teacher-forced agreement: each fp32 output (outputs[i], after prompt token ids prompts[i]) scored by `core`
    (prompt log-probabilities with the top token); the share of output positions where core's most likely next
    token is fp32's. Unlike greedy agreement, one early difference does not decide every later position."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for i, (ids, out) in enumerate(zip(prompts, outputs, strict=True)):
        core.add(core.prepare(GenerateRequest(f"tf-{i}", model, prompt_token_ids=(*ids, *out), sampling=sp)))
    alike = total = 0
    while core.has_work():
        for ev in core.step():
            for lp in ev.prompt_logprobs[len(prompts[int(ev.request_id[3:])]):]:
                alike += lp.top[0][0] == lp.token_id
                total += 1
    return round(alike / total, 4) if total else float("nan")


@torch.inference_mode()
def decode_step_tok_s(cores: dict[str, EngineCore], batch: int, context: int, reps: int) -> dict[str, list[float]]:
    """Each core's all-decode step alone, at `batch` sequences of `context` tokens (random K/V written straight
    into its cache: the step's cost does not depend on the values), the cores taking turns `reps` times; each
    step's batch / seconds. What a long-running batch's decode steps cost, without prefill in the figure."""
    figures: dict[str, list[float]] = {name: [] for name in cores}
    steps = {}
    for name, core in cores.items():
        runner, bs = core.runner, core.runner.block_size
        per_seq = -(-(context + 1) // bs)
        if batch * per_seq > core.pool.num_blocks:
            raise ValueError(f"--kv-cache-mb holds {core.pool.num_blocks} blocks, the decode figure needs "
                             f"{batch * per_seq}")
        seqs = [(context, 1, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]
        used = raw(runner.kv_storage)[:, :, :batch * per_seq]  # [layers, 2, blocks, bs, kv_heads, row width]
        for layer in used:  # the cache's own rows, scales included (a layer at a time: fp32 noise is 4x an int8 row)
            noise = torch.randn(layer.shape[:-1] + (runner.model.config.head_dim,))
            layer.copy_(raw(quantize(noise, runner.kv_storage.dtype)))
        meta = runner.model.attention.build_metadata(seqs, bs, runner.device, runner.model.dtype)
        ids = torch.zeros(batch, dtype=torch.long)
        steps[name] = (runner.model, ids, torch.full((batch,), context), meta, runner.kv_caches, torch.arange(batch))
    for _ in range(reps):
        for name, (model, *args) in steps.items():
            t0 = time.perf_counter()
            model.forward(*args)
            figures[name].append(round(batch / (time.perf_counter() - t0), 2))
    return figures


def run_kv_bench(model: str, new_tokens: int, batches: str, kv_cache_dtypes: str, rounds: int = 3,
                 kv_cache_mb: int = 1024, decode_contexts: str = "256,512", decode_reps: int = 20) -> dict:
    sizes, dtypes = _sizes(batches), _dtypes(kv_cache_dtypes)
    decode_contexts = _sizes(decode_contexts) if decode_contexts else []
    torch.manual_seed(0)
    loaded = load_model(resolve_model(model), torch.float32, torch.device("cpu"))  # (read-only: shared)
    cores = {}
    for d in dtypes:  # speculation off: one token per pass, as in the other throughput benches
        cfg = EngineConfig(model=model, device="cpu", dtype="float32", kv_cache_dtype=d, max_num_seqs=sizes[-1],
                           max_num_batched_tokens=2048, speculative_tokens=0, kv_cache_bytes=kv_cache_mb * 2**20)
        cores[d] = EngineCore(cfg, loaded=loaded)
    prompts = bench_prompts(sizes[-1])
    for core in cores.values():  # warm-up: kernel builds, the allocator's pages
        core.run(_requests(prompts, 2, model, "warm"))
    runs: dict[int, dict[str, list[float]]] = {b: {d: [] for d in cores} for b in sizes}
    outputs: dict[int, dict[str, dict[str, list[int]]]] = {b: {d: {} for d in cores} for b in sizes}
    for r in range(max(rounds, 1)):
        for b in sizes:
            def keep(name: str, events: list, b=b) -> None:
                for ev in events:
                    outputs[b][name].setdefault(ev.request_id.rsplit("-", 1)[1], []).extend(ev.token_ids)

            figures = step_interleaved(cores, {d: _requests(prompts[:b], new_tokens, model, f"{d}{r}b{b}")
                                               for d in cores}, keep if r == 0 else None)
            for d, tok_s in figures.items():
                runs[b][d].append(round(tok_s, 2))
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "attention_backend_used": cores[BASE].runner.model.attention.name},
        "model": model, "dtype": "float32", "new_tokens": new_tokens, "measure": "step-interleaved",
        "kv_block_bytes": {d: block_bytes(core.config, loaded.config) for d, core in cores.items()},
        "kv_blocks": {d: core.pool.num_blocks for d, core in cores.items()},
        "prompt_perplexity": {d: round(prompt_perplexity(core, prompts, model), 4) for d, core in cores.items()},
    }
    for b in sizes:
        row: dict = {f"{d}_tok_s": round(statistics.harmonic_mean(runs[b][d]), 2) for d in cores}
        for d in dtypes[1:]:
            row[f"{d}_vs_{BASE}"] = round(row[f"{d}_tok_s"] / row[f"{BASE}_tok_s"], 3)
            row[f"paired_{d}_vs_{BASE}"] = paired_ratio(runs[b], d, BASE)
            row[f"{d}_agreement"] = {**agreement(outputs[b][d], outputs[b][BASE]),
                                     "positions_alike": positions_alike(outputs[b][d], outputs[b][BASE])}
        row["rounds"] = runs[b]
        results[f"batch{b}"] = row
    for context in decode_contexts:
        figures = decode_step_tok_s(cores, sizes[-1], context, decode_reps)
        row = {f"{d}_tok_s": max(figures[d]) for d in dtypes}  # (best of reps: a shared machine only slows)
        for d in dtypes[1:]:
            row[f"{d}_vs_{BASE}"] = round(row[f"{d}_tok_s"] / row[f"{BASE}_tok_s"], 3)
            row[f"paired_{d}_vs_{BASE}"] = paired_ratio(figures, d, BASE)
        results[f"decode_step_batch{sizes[-1]}_context{context}"] = row
    base_out = outputs[sizes[-1]][BASE]  # {request index: fp32 tokens}
    ids = [cores[BASE].prepare(GenerateRequest(f"ids-{i}", model, prompt=prompts[int(i)])).prompt_ids for i in base_out]
    results["next_token_agreement"] = {d: next_token_agreement(cores[d], model, ids, list(base_out.values()))
                                       for d in dtypes[1:]}
    return results
