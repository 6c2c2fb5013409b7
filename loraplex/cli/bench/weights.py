"""bf16 base weights against fp32 ones under the same fp32 model (EngineConfig.weight_dtype), in one run.

Two engines on the same model take turns step by step (step_interleaved) over the same greedy
requests at each batch size: one packs its projections in fp32, the other rounds every weight to
bf16 at load and packs them in bf16 (kernels/cpu/linear_bf16.c). Reported per batch: each engine's
tokens/s (the harmonic mean of its rounds: every round generates the same tokens), their ratio (and
the median of the per-round ratios), and how far the bf16 engine's greedy tokens follow the fp32
engine's. At batch 1 a step reads every packed weight once, so each engine is also set against the
memory roofline measured in the same rounds: read bandwidth over the bytes of its packed weights.
What the rounding costs in quality: each engine's perplexity over the bench's prompts (their tokens'
log-probabilities, as `echo` with `logprobs` scores a prompt).
"""

from __future__ import annotations

import math
import platform
import statistics

import torch

from loraplex.cli.bench import roofline
from loraplex.cli.bench.engine import bench_prompts, paired_ratio, step_interleaved
from loraplex.cli.bench.lora import agreement
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.models.loader import load_model, resolve_model

WEIGHT_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _requests(prompts: list[str], new_tokens: int, model: str, tag: str) -> list[GenerateRequest]:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [GenerateRequest(f"{tag}-{i}", model, prompt=p, sampling=sp) for i, p in enumerate(prompts)]


def prompt_perplexity(core: EngineCore, prompts: list[str], model: str) -> float:
    """exp of the mean negative log-probability of every prompt token after the first, each prompt
    scored by the engine (prompt log-probabilities, one token generated)."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for i, p in enumerate(prompts):
        core.add(core.prepare(GenerateRequest(f"ppl-{i}", model, prompt=p, sampling=sp)))
    logprobs: list[float] = []
    while core.has_work():
        for ev in core.step():
            logprobs += [lp.logprob for lp in ev.prompt_logprobs if lp.logprob is not None]
    return math.exp(-sum(logprobs) / len(logprobs))


def run_weights_bench(model: str, new_tokens: int, batches: str, rounds: int = 3) -> dict:
    try:
        sizes = sorted({int(b) for b in batches.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batches: positive batch sizes, comma-separated, got {batches!r}")
    torch.manual_seed(0)
    src = resolve_model(model)
    cores = {}
    for name, wdtype in WEIGHT_DTYPES.items():
        # speculation off: one token per pass over the weights, as the roofline assumes
        cfg = EngineConfig(model=model, device="cpu", dtype="float32", weight_dtype=wdtype, max_num_seqs=sizes[-1],
                           max_num_batched_tokens=2048, speculative_tokens=0)
        cores[name] = EngineCore(cfg, loaded=load_model(src, torch.float32, torch.device("cpu"),
                                                         weight_dtype=cfg.weight_torch_dtype))
    prompts = bench_prompts(sizes[-1])
    for core in cores.values():  # warm-up: kernel builds, the allocator's pages
        core.run(_requests(prompts, 2, model, "warm"))
    runs: dict[int, dict[str, list[float]]] = {b: {name: [] for name in cores} for b in sizes}
    outputs: dict[int, dict[str, dict[str, list[int]]]] = {b: {name: {} for name in cores} for b in sizes}
    bandwidth = []
    for r in range(max(rounds, 1)):
        bandwidth.append(roofline.mem_read_gbs())
        for b in sizes:
            def keep(name: str, events: list, b=b) -> None:
                for ev in events:
                    outputs[b][name].setdefault(ev.request_id.rsplit("-", 1)[1], []).extend(ev.token_ids)

            figures = step_interleaved(cores, {name: _requests(prompts[:b], new_tokens, model, f"{name}{r}b{b}")
                                               for name in cores}, keep if r == 0 else None)
            for name, tok_s in figures.items():
                runs[b][name].append(round(tok_s, 2))
    gbs = round(max(bandwidth), 2)
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "model": model, "dtype": "float32", "new_tokens": new_tokens, "measure": "step-interleaved",
        "mem_read_gbs": gbs,
        "packed_bytes": {name: core.runner.model.packed_bytes() for name, core in cores.items()},
    }
    perplexity = {name: prompt_perplexity(core, prompts, model) for name, core in cores.items()}
    results["prompt_perplexity"] = {name: round(v, 4) for name, v in perplexity.items()}
    results["prompt_perplexity"]["bf16_vs_fp32"] = round(perplexity["bf16"] / perplexity["fp32"], 4)
    for b in sizes:
        row = {f"{name}_tok_s": round(statistics.harmonic_mean(runs[b][name]), 2) for name in cores}
        row["bf16_vs_fp32"] = round(row["bf16_tok_s"] / row["fp32_tok_s"], 3)
        row["paired_bf16_vs_fp32"] = paired_ratio(runs[b], "bf16", "fp32")
        row["rounds"] = runs[b]
        row["bf16_agreement"] = agreement(outputs[b]["bf16"], outputs[b]["fp32"])
        if b == 1:
            for name in cores:
                roof = gbs * 1e9 / results["packed_bytes"][name]
                row[f"{name}_roofline_tok_s"] = round(roof, 2)
                row[f"{name}_fraction_of_roofline"] = round(row[f"{name}_tok_s"] / roof, 3)
        results[f"batch{b}"] = row
    return results
