"""Multi-LoRA throughput: one batch over 1, zipf-many or all-distinct adapters, against the base model and HF PEFT.

- Patterns: `identical` (one adapter), `zipf`, `distinct`, and `base` (no adapter), against HF PEFT's mixed-adapter
  batch, in one run.
- zipf_rank64_fleet runs zipf's batch in an engine whose fleet also holds a rank-64 adapter (so its slot buffers are of
  rank 64): what a mixed-rank fleet costs the rank-16 adapters.
- zipf_bf16_slots and distinct_bf16_slots run those batches with bf16 slot buffers under an fp32 model
  (EngineConfig.lora_dtype; not run under a 16-bit model, whose slots are 16-bit already): half the adapter bytes a
  step reads, each adapter's weights rounded to bf16 once. What the rounding costs is reported beside their speed: of
  the first round's greedy tokens, how many requests match the fp32 slots' tokens exactly, and the share of tokens
  generated before a request's first difference.
- The adapters are made by PEFT itself (rank 16 on all seven projections, random non-zero A and B), saved to a
  temporary directory, and loaded by both systems from there. Everything runs on one device and dtype (--device,
  --dtype): the engines, HF PEFT and the adapter slots of the load and swap timings.
- Each pattern (and the base model) runs on its own engine over the same loaded weights, and the engines take turns
  step by step (step_interleaved), so that steps tens of milliseconds apart meet the same phases of a shared VM whose
  speed drifts over seconds (whole runs taking turns left a fast or slow phase to one side). A pattern's tok/s is its
  tokens over the time spent in its own steps, over all rounds.
- HF PEFT's batch runs once per round, right after that round's steps, so it meets the machine's phases in turn with
  ours; its tok/s is the harmonic mean of its rounds, as ours are.
- Every engine and PEFT are warmed up on the whole batch first (the engines for one step past
  lora_merge_after_steps), so the rounds measure the steady state, not the first full prefill or the identical
  pattern's merge.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path

import torch

from loraplex.cli.bench import roofline
from loraplex.cli.bench.engine import BenchTarget, bench_prompts, hf_model, left_padded, paired_ratio, step_interleaved
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.lora.slots import LoraSlots
from loraplex.engine.lora.st_reader import drop_from_page_cache

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# zipf's batch again, in an engine whose fleet also holds one adapter of this rank (loaded, served, kept in
# its slot): the slot buffers' rank is then 64, and the rank-16 adapters must not pay for it.
MIXED, MIXED_RANK = "zipf_rank64_fleet", 64
# patterns run again with bf16 slot buffers (the model stays fp32): pattern -> the pattern whose batch it runs
BF16_SLOTS = {"zipf_bf16_slots": "zipf", "distinct_bf16_slots": "distinct"}


def zipf_choices(n_requests: int, n_adapters: int, s: float, seed: int = 0) -> list[int]:
    """Adapter index per request, P(k) proportional to 1 / (k + 1)^s."""
    weights = [1.0 / (k + 1) ** s for k in range(n_adapters)]
    return random.Random(seed).choices(range(n_adapters), weights=weights, k=n_requests)


def make_adapters(loaded, root: Path, count: int, rank: int, device: torch.device | None = None,
                  dtype: torch.dtype | None = None):
    """Saves `count` PEFT adapters and returns the PEFT model holding all of them (names a0..), over
    hf_model(loaded, device, dtype) (None: the loaded weights' device and dtype)."""
    from peft import LoraConfig, get_peft_model

    base = hf_model(loaded, device, dtype)
    model = None
    gen = torch.Generator().manual_seed(1234)
    for i in range(count):
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=f"a{i}")
        else:
            model.add_adapter(f"a{i}", cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if f".a{i}." in name and ("lora_A" in name or "lora_B" in name):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.04)
    model.save_pretrained(root)  # PEFT writes each named adapter to root/<name>
    return model.eval()


def agreement(got: dict[str, list[int]], want: dict[str, list[int]]) -> dict:
    """How far greedy outputs follow reference ones: requests whose tokens are all the same, and the share
    of tokens generated before each request's first difference."""
    same = before = total = 0
    for key, ref in want.items():
        out = got.get(key, [])
        same += out == ref
        before += next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))
        total += len(ref)
    return {"requests_as_fp32": same, "requests": len(want), "tokens_before_difference": round(before / total, 3)
            if total else None}


def adapter_path(root: Path, i: int) -> Path:
    return root / f"a{i}"


def _requests(prompts, adapters, new_tokens: int, model: str, tag: str) -> list[GenerateRequest]:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [GenerateRequest(f"{tag}{i}", model, prompt=p, sampling=sp, adapter=a)
            for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))]


@torch.inference_mode()
def _peft(model, tokenizer, prompts, adapter_names, new_tokens: int) -> float:
    ids, mask, width = left_padded(tokenizer, prompts, model.device)
    t0 = roofline.clock(model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, adapter_names=adapter_names)
    return (out.shape[1] - width) * out.shape[0] / (roofline.clock(model.device) - t0)


def _evict(adapter_dir: Path) -> None:
    """Drops the adapter's files from the page cache (written back first), so the next read comes from disk."""
    for file in adapter_dir.iterdir():
        drop_from_page_cache(file)


def _slots(loaded, target: BenchTarget, rank: int, max_loras: int, max_cpu_loras: int) -> LoraSlots:
    return LoraSlots(loaded.config, max_loras=max_loras, max_lora_rank=rank, max_cpu_loras=max_cpu_loras,
                     dtype=target.dtype, device=target.device)


def _load_ms(loaded, target: BenchTarget, root: Path, count: int, rank: int, from_disk: bool) -> float:
    """Median cold load: parse + validate one adapter from its files and write it into a device slot.
    `from_disk`: each adapter's files are dropped from the page cache first, so the read is the disk's;
    else they are read once before, so it is the page cache's. (Without either, the figure depended on
    the file's age: on the Zen 4 VM, pages of files some minutes old were reclaimed, and the load
    took 16-21 ms against 5-7 ms for files just written.)"""
    slots = _slots(loaded, target, rank, max_loras=2, max_cpu_loras=1)
    times = []
    for i in range(count):
        path = adapter_path(root, i)
        if from_disk:
            _evict(path)
        else:
            for file in path.iterdir():
                file.read_bytes()
        t0 = roofline.clock(target.device)
        slots.register(f"cold{i}", path)
        slots.acquire(f"cold{i}")
        times.append((roofline.clock(target.device) - t0) * 1000)
        slots.release(f"cold{i}")
        slots.unregister(f"cold{i}")
    return statistics.median(times)


def _swap_ms(loaded, target: BenchTarget, root: Path, rank: int, swaps: int = 30) -> float:
    """Median write of an adapter from the CPU tier into a device slot, evicting another: what a fleet
    larger than max_loras pays on a request's path (three adapters taking turns in one slot)."""
    slots = _slots(loaded, target, rank, max_loras=1, max_cpu_loras=3)
    for i in range(3):
        slots.register(f"swap{i}", adapter_path(root, i))
    times = []
    for k in range(swaps + 3):  # the first round of three also fills the slot's tables: not counted
        name = f"swap{k % 3}"
        t0 = roofline.clock(target.device)
        slots.acquire(name)
        if k >= 3:
            times.append((roofline.clock(target.device) - t0) * 1000)
        slots.release(name)
    return statistics.median(times)


def run_lora_bench(model: str, batch: int, rank: int, new_tokens: int, peft_new_tokens: int | None = None,
                   skip_peft: bool = False, rounds: int = 3, device: str = "auto", dtype: str = "auto",
                   attention_backend: str = "auto") -> dict:
    target = BenchTarget.parse(device, dtype, attention_backend)
    # PEFT generates as many tokens as our engines by default: at 16 instead of 64 its tok/s on the
    # Zen 1 VM was 14.4-16.0 against 17.3-18.4, its prefill spread over fewer tokens (bench/RESULTS.md).
    peft_new_tokens = new_tokens if peft_new_tokens is None else peft_new_tokens
    # bf16 slots are a choice under an fp32 model only; under a 16-bit one they are the slots' own dtype
    bf16_slots = BF16_SLOTS if target.dtype == torch.float32 else {}
    loaded = target.load(model)
    prompts = bench_prompts(batch)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        peft_model = make_adapters(loaded, root, batch, rank, target.device, target.dtype)
        zipf = [f"a{k}" for k in zipf_choices(batch, batch, 1.5)]
        patterns = {"base": [None] * batch, "identical": ["a0"] * batch, "zipf": zipf,
                    "distinct": [f"a{i}" for i in range(batch)], MIXED: zipf}
        patterns.update({name: patterns[of] for name, of in bf16_slots.items()})
        big_rank = max(rank, MIXED_RANK)
        make_adapters(loaded, root / "big", 1, big_rank, target.device, target.dtype)
        cores = {}
        for name, adapters in patterns.items():  # one engine per pattern, all on the same loaded weights
            used = sorted({a for a in adapters if a is not None}, key=lambda a: int(a[1:]))
            core = EngineCore(EngineConfig(model=model, max_num_seqs=batch, max_num_batched_tokens=2048,
                                           max_loras=max(len(used), 1) + (name == MIXED),
                                           max_lora_rank=big_rank if name == MIXED else rank,
                                           lora_dtype="bfloat16" if name in bf16_slots else "auto",
                                           **target.config_kwargs()), loaded=loaded)
            for a in used:
                core.add_adapter(a, str(adapter_path(root, int(a[1:]))))
            if name == MIXED:  # the fleet's rank-64 adapter serves a request and stays in its slot
                core.add_adapter("big", str(adapter_path(root / "big", 0)))
                core.run(_requests(prompts[:1], ["big"], 2, model, "big"))
            # the whole batch, one step past the merge's threshold: every round then measures the steady
            # state (kernel tables, folds, a merged copy, the allocator's pages), not the first round's setup
            core.run(_requests(prompts, adapters, core.config.lora_merge_after_steps + 2, model, "warm"))
            cores[name] = core
        runs = {name: [] for name in patterns}
        peft_runs = []
        if not skip_peft:  # warmed up on the whole batch, as the engines are
            _peft(peft_model, loaded.tokenizer, prompts, patterns["distinct"], 2)
        outputs: dict[str, dict[str, list[int]]] = {name: {} for name in patterns}  # first round: request -> tokens

        def keep(name: str, events: list) -> None:
            for ev in events:
                outputs[name].setdefault(ev.request_id.rsplit("-", 1)[1], []).extend(ev.token_ids)

        for r in range(max(rounds, 1)):
            figures = step_interleaved(cores, {name: _requests(prompts, adapters, new_tokens, model, f"{name}{r}-")
                                               for name, adapters in patterns.items()}, keep if r == 0 else None)
            for name, tok_s in figures.items():
                runs[name].append(round(tok_s, 2))
            if not skip_peft:
                peft_runs.append(round(_peft(peft_model, loaded.tokenizer, prompts, patterns["distinct"],
                                             peft_new_tokens), 2))
        results = {
            "machine": target.describe(cores["base"]), "model": model, "dtype": roofline.dtype_name(target.dtype),
            "batch": batch, "rank": rank, "new_tokens": new_tokens,
            "targets": "q,k,v,o,gate,up,down", "measure": "step-interleaved", "rounds": runs,
            # every round generates the same tokens, so tokens over all step time is the harmonic mean
            "base_tok_s": round(statistics.harmonic_mean(runs["base"]), 2),
        }
        del patterns["base"]
        for name, adapters in patterns.items():
            results[name] = {"tok_s": round(statistics.harmonic_mean(runs[name]), 2),
                             "distinct_adapters": len(set(adapters))}
        results[MIXED]["buffer_rank"] = cores[MIXED].lora.r_max
        for name, of in bf16_slots.items():
            results[name].update(slot_dtype=roofline.dtype_name(cores[name].lora.dtype),
                                 **agreement(outputs[name], outputs[of]))
        for key, from_disk in (("adapter_load_ms", True), ("adapter_load_cached_ms", False)):
            results[key] = round(_load_ms(loaded, target, root, min(9, batch), rank, from_disk), 2)
        results["adapter_slot_swap_ms"] = round(_swap_ms(loaded, target, root, rank), 2) if batch >= 3 else None
        if not skip_peft:
            results["peft_distinct"] = {"tok_s": round(statistics.harmonic_mean(peft_runs), 2),
                                        "new_tokens": peft_new_tokens, "rounds": peft_runs}
    base = results["base_tok_s"]
    results["ratios"] = {f"{k}_vs_base": round(results[k]["tok_s"] / base, 3) for k in patterns}
    results["paired_ratios"] = {f"{k}_vs_base": paired_ratio(runs, k, "base") for k in patterns}
    if not skip_peft:
        for name in ("distinct", *(k for k in bf16_slots if k.startswith("distinct"))):
            results["ratios"][f"{name}_vs_peft"] = round(results[name]["tok_s"] / results["peft_distinct"]["tok_s"], 2)
            results["paired_ratios"][f"{name}_vs_peft"] = paired_ratio({**runs, "peft": peft_runs}, name, "peft")
    return results
