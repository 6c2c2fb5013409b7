"""Speculative decoding by n-gram lookup against plain decoding, in one run.

- Two workloads of greedy chat requests, on the same engine settings but `speculative_tokens`: `quote` asks to
  repeat, correct or rewrite a given paragraph (outputs that reuse their input, where lookups find drafts); `free`
  asks for new text (where they rarely do, so its ratio is what a wrong guess costs).
- Each at batch 1, 4 and 8 (max_num_seqs; the engine's default `speculative_max_seqs` is 8), and at 16 with
  speculation forced on (`speculative_max_seqs` 16: what the default avoids).
- The two engines take turns step by step (engine.step_interleaved); every round counts, reported as the best round's
  ratio and the median of paired ratios.
- Both must produce the same tokens (`same_tokens`): a draft is only kept where the model's own argmax agrees.

acceptance       kept drafts / proposed drafts
tokens_per_step  generated tokens / steps that generated, with drafts
"""

from __future__ import annotations

import torch

from loraplex.cli.bench.engine import paired_ratio, step_interleaved
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.models.loader import load_model, resolve_model

PARAGRAPHS = [
    "The warehouse opens at seven in the morning. Trucks arrive from the north gate and unload at docks three to "
    "nine. Every pallet is scanned twice, once at the dock and once at its shelf, so that the inventory stays exact.",
    "Our library lends books for three weeks. A book may be renewed twice online unless another reader has reserved "
    "it. Late books cost ten cents a day, and the fine never exceeds the price of the book.",
    "To reset the router, hold the small button on its back for ten seconds until the light blinks orange. Wait two "
    "minutes, then connect to the network named on the sticker with the password printed below it.",
    "The committee meets on the first Monday of each month in room twelve. Minutes are sent to all members within a "
    "week, and any member may add an item to the agenda by writing to the secretary.",
]
TASKS = ["Repeat this text exactly, word for word:", "Rewrite this text in the past tense:",
         "Correct any mistakes in this text and return it in full:", "Turn this text into a bulleted list:"]
FREE = ["Write a short story about a dragon who learns to cook.", "Explain how a rainbow forms.",
        "Give me five ideas for a birthday party.", "Describe your perfect weekend in a few sentences."]
STYLES = ["", " Be brief.", " Use simple words.", " Answer for a child."]
BATCHES = ((1, 8), (4, 8), (8, 8), (16, 16))  # (max_num_seqs, speculative_max_seqs)


def _requests(model: str, prompts: list[str], new_tokens: int) -> list[GenerateRequest]:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    return [GenerateRequest(f"r{i}", model, messages=({"role": "user", "content": p},), sampling=sp)
            for i, p in enumerate(prompts)]


def _compare(make_core, reqs: list[GenerateRequest], k: int, rounds: int) -> dict:
    cores = {"plain": make_core(0), "spec": make_core(k)}
    for core in cores.values():  # warm-up, untimed
        core.run(reqs[:1])
    figures: dict[str, list[float]] = {"plain": [], "spec": []}
    outputs: dict[str, dict[str, list[int]]] = {"plain": {}, "spec": {}}
    steps = dict.fromkeys(cores, 0)

    def record(name: str, events: list) -> None:
        steps[name] += any(ev.token_ids for ev in events)
        for ev in events:
            outputs[name].setdefault(ev.request_id, []).extend(ev.token_ids)

    before = {name: core.stats() for name, core in cores.items()}
    for _ in range(rounds):
        for name in outputs:
            outputs[name].clear()
        tok_s = step_interleaved(cores, {"plain": reqs, "spec": reqs}, record)
        for name in figures:
            figures[name].append(tok_s[name])
    after = {name: core.stats() for name, core in cores.items()}
    drafted = after["spec"].speculation.draft_tokens - before["spec"].speculation.draft_tokens
    kept = after["spec"].speculation.accepted_tokens - before["spec"].speculation.accepted_tokens
    generated = {name: after[name].requests.generated_tokens - before[name].requests.generated_tokens for name in cores}
    best = {name: max(values) for name, values in figures.items()}
    return {
        "requests": len(reqs), "plain_tok_s": round(best["plain"], 2), "spec_tok_s": round(best["spec"], 2),
        "ratio_spec_over_plain": round(best["spec"] / best["plain"], 3),
        "paired_ratio": paired_ratio(figures, "spec", "plain"),
        "acceptance": round(kept / drafted, 3) if drafted else 0.0,
        "tokens_per_step": {name: round(generated[name] / steps[name], 2) for name in steps},
        "same_tokens": outputs["plain"] == outputs["spec"],
        "rounds": {name: [round(v, 2) for v in values] for name, values in figures.items()},
    }


def run_speculative_bench(model: str, tokens: int, new_tokens: int, rounds: int) -> dict:
    torch.manual_seed(0)
    loaded = load_model(resolve_model(model), torch.float32, torch.device("cpu"))

    def core_for(seqs: int, spec_seqs: int):
        return lambda k: EngineCore(EngineConfig(model=model, device="cpu", dtype="float32", max_num_seqs=seqs,
                                                 speculative_tokens=k, speculative_max_seqs=spec_seqs), loaded=loaded)

    # 16 of each; the first 4 pair each task with its own paragraph, each question with no style
    quote = [f"{TASKS[(i + j) % 4]}\n\n{PARAGRAPHS[i]}" for j in range(4) for i in range(4)]
    free = [f"{question}{style}" for style in STYLES for question in FREE]
    results: dict = {"model": model, "speculative_tokens": tokens, "new_tokens": new_tokens,
                     "threads": torch.get_num_threads()}
    for name, prompts in (("quote", quote), ("free", free)):
        for seqs, spec_seqs in BATCHES:
            reqs = _requests(model, prompts[:max(seqs, 4)], new_tokens)
            label = f"{name}_batch{seqs}" + ("_forced" if seqs > 8 else "")
            results[label] = _compare(core_for(seqs, spec_seqs), reqs, tokens, rounds)
    return results
