"""One model at several base-weight formats under the same fp32 model (EngineConfig.weight_dtype), in one run.

- Formats: fp32 and bf16 panels, int8 and int4 (Q8_0 / Q4_1 blocks quantized at load), and for a GGUF
  model `gguf`: the file's own blocks (weight_dtype auto); `int8_a8`, `int4_a8` and `gguf_a8` the same blocks with
  int8 activations (EngineConfig.activation_dtype; not in the default list).
- The engines take turns step by step (step_interleaved) over the same greedy requests at each batch size;
  per batch each one's tokens/s (harmonic mean of its rounds) and its ratio to fp32 (best rounds, and the
  median of per-round ratios), and how far its greedy tokens follow fp32's.
- At batch 1 a step reads every packed weight once, so each is set against the memory roofline measured in
  the same rounds (read bandwidth over its packed bytes).
- Quality: each format's perplexity over the bench's prompts (its tokens' log-probabilities, as `echo` with
  `logprobs` scores a prompt); memory: each engine's resident weight bytes (what loraplex_model_weight_bytes
  shows).
- With llama_cpp importable and `--llama-cpp`, llama.cpp runs the same GGUF in the same rounds
  (bench/llama_cpp_baseline.py); it is never a dependency of the project.
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

# bench format -> EngineConfig.weight_dtype
FORMATS = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8", "int4": "int4", "gguf": "auto",
           "int8_a8": "int8", "int4_a8": "int4", "gguf_a8": "auto"}
DEFAULT_FORMATS = "fp32,bf16,int8,int4,gguf"


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


def _parse(batches: str, formats: str, gguf: bool) -> tuple[list[int], list[str]]:
    try:
        sizes = sorted({int(b) for b in batches.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1 or sizes[-1] > 256:
        raise ValueError(f"--batches: positive batch sizes up to 256, comma-separated, got {batches!r}")
    names = [f for f in formats.split(",") if f]
    unknown = [f for f in names if f not in FORMATS]
    if unknown or "fp32" not in names:
        raise ValueError(f"--formats: fp32 and any of {', '.join(FORMATS)}, comma-separated, got {formats!r}")
    return sizes, [f for f in FORMATS if f in names and (not f.startswith("gguf") or gguf)]


def _engines(model: str, formats: list[str], max_seqs: int) -> dict[str, EngineCore]:
    src = resolve_model(model)
    cores = {}
    for name in formats:
        # speculation off: one token per pass over the weights, as the roofline assumes
        cfg = EngineConfig(model=model, device="cpu", dtype="float32", weight_dtype=FORMATS[name],
                           activation_dtype="int8" if name.endswith("_a8") else "float32", max_num_seqs=max_seqs,
                           max_num_batched_tokens=2048, speculative_tokens=0)
        cores[name] = EngineCore(cfg, loaded=load_model(src, torch.float32, torch.device("cpu"),
                                                         weight_dtype=cfg.weight_torch_dtype, quant=cfg.weight_quant))
    return cores


def run_quant_bench(model: str, new_tokens: int, batches: str, rounds: int = 3, formats: str = DEFAULT_FORMATS,
                    llama_cpp: bool = False) -> dict:
    src = resolve_model(model)
    sizes, names = _parse(batches, formats, src.kind == "gguf")
    baseline = None
    if llama_cpp:
        from loraplex.cli.bench.llama_cpp_baseline import LlamaCppBaseline  # (raises a clear error without llama_cpp)

        if src.kind != "gguf":
            raise ValueError(f"--llama-cpp needs a GGUF model, {model!r} is {src.kind}")
        baseline = LlamaCppBaseline(src.path, max_seqs=sizes[-1], threads=torch.get_num_threads())
    torch.manual_seed(0)
    cores = _engines(model, names, sizes[-1])
    prompts = bench_prompts(sizes[-1])
    for core in cores.values():  # warm-up: kernel builds, the allocator's pages
        core.run(_requests(prompts, 2, model, "warm"))
    columns = [*cores, *(["llama_cpp"] if baseline else [])]
    runs: dict[int, dict[str, list[float]]] = {b: {name: [] for name in columns} for b in sizes}
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
            if baseline is not None:
                figures["llama_cpp"] = baseline.tokens_per_s(prompts[:b], new_tokens)
            for name, tok_s in figures.items():
                runs[b][name].append(round(tok_s, 2))
    return _results(model, new_tokens, sizes, cores, runs, outputs, round(max(bandwidth), 2), prompts)


def _results(model, new_tokens, sizes, cores, runs, outputs, gbs, prompts) -> dict:
    resident = {name: core.weight_bytes for name, core in cores.items()}
    packed = {name: core.runner.model.packed_bytes() for name, core in cores.items()}
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "model": model, "dtype": "float32", "new_tokens": new_tokens, "measure": "step-interleaved",
        "mem_read_gbs": gbs, "packed_bytes": packed, "resident_bytes": resident,
        "perplexity": {name: round(prompt_perplexity(core, prompts, model), 4) for name, core in cores.items()},
    }
    results["perplexity_vs_fp32"] = {name: round(p / results["perplexity"]["fp32"], 4)
                                     for name, p in results["perplexity"].items()}
    for b in sizes:
        row = {f"{name}_tok_s": round(statistics.harmonic_mean(figs), 2) for name, figs in runs[b].items()}
        for name in runs[b]:
            if name != "fp32":
                row[f"{name}_vs_fp32"] = round(row[f"{name}_tok_s"] / row["fp32_tok_s"], 3)
                row[f"paired_{name}_vs_fp32"] = paired_ratio(runs[b], name, "fp32")
        if "llama_cpp" in runs[b]:
            for name in cores:
                row[f"{name}_vs_llama_cpp"] = round(row[f"{name}_tok_s"] / row["llama_cpp_tok_s"], 3)
        row["rounds"] = runs[b]
        row["agreement"] = {name: agreement(outputs[b][name], outputs[b]["fp32"]) for name in cores if name != "fp32"}
        if b == 1:
            for name in cores:
                roof = gbs * 1e9 / packed[name]
                row[f"{name}_roofline_tok_s"] = round(roof, 2)
                row[f"{name}_fraction_of_roofline"] = round(row[f"{name}_tok_s"] / roof, 3)
        results[f"batch{b}"] = row
    return results
