"""Guided decoding (`response_format`): what holding the output to a JSON Schema costs, in one run.

- The same chat prompts (describe a person as JSON) run guided and free. Each free request generates exactly as many
  tokens as its guided twin did (end-of-sequence ignored), so both have the same batch shapes step by step and the
  ratio is the cost of the masks alone.
- The two engines take turns step by step (engine.step_interleaved) and swap sides every round, since two engine
  instances of one model can differ by several percent on the same free requests: each side meets both.
- Every round counts, reported as the best round's ratio and the median of paired ratios (use an even number of
  rounds).

vocab_build_ms   build llguidance's view of the tokenizer (once per tokenizer, at model load)
cold             the first guided run of a schema: its compile and llguidance's lexer states built on the
                 way (both engines have run a few free steps first, so this is guidance, not warm-up)
guided / free    the same requests again beside the free twins (masks computed on worker threads while
                 each forward pass runs: engine/guided/masks.py)
stop_valid       of the guided outputs, the share that ended by themselves and parse as JSON
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from loraplex.cli.bench.engine import paired_ratio, step_interleaved
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import Completion, EngineCore
from loraplex.engine.guided.tokenizer import guide_tokenizer
from loraplex.engine.models.loader import load_model, resolve_model

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string"},
    "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "employed": {"type": "boolean"}}, "required": ["name", "age", "city", "skills", "employed"]}
JSON_MODE = {"type": "object"}
PEOPLE = ["Ann, a nurse", "Bo, a carpenter", "Chen, a pilot", "Dara, a chemist", "Eli, a baker", "Fay, a judge",
          "Gus, a welder", "Hana, a poet"]


def _requests(model: str, n: int, schema: dict, new_tokens: int) -> list[GenerateRequest]:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, json_schema=json.dumps(schema))
    return [GenerateRequest(f"g{i}", model, messages=({"role": "user", "content": (
        f"Describe {PEOPLE[i % len(PEOPLE)]} from town number {i}, as JSON.")},), sampling=sp) for i in range(n)]


def _free_twins(guided: list[GenerateRequest], done: list[Completion]) -> list[GenerateRequest]:
    """Free requests generating exactly as many tokens as their guided twins did."""
    pairs = enumerate(zip(guided, done, strict=True))
    return [GenerateRequest(f"f{i}", r.model, messages=r.messages, sampling=SamplingParams(
        max_tokens=len(c.token_ids), temperature=0.0, ignore_eos=True)) for i, (r, c) in pairs]


def _stop_valid(done: list[Completion]) -> float:
    def valid(c: Completion) -> bool:
        try:
            return c.finish_reason == "stop" and isinstance(json.loads(c.text), dict)
        except ValueError:
            return False
    return round(sum(map(valid, done)) / len(done), 3)


def _compare(make_core, model: str, schema: dict, n: int, new_tokens: int, rounds: int) -> dict:
    guided_core, free_core = make_core(), make_core()
    guided = _requests(model, n, schema, new_tokens)  # each section's own schema: its masks start uncached
    warm_up = [GenerateRequest(r.request_id, model, messages=r.messages, sampling=SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True)) for r in guided]
    for core in (guided_core, free_core):  # both engines' first steps, free, before anything is timed
        core.run(warm_up)
    t0 = time.perf_counter()
    done = guided_core.run(guided)
    cold = sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)
    free = _free_twins(guided, done)
    free_core.run(guided)  # the other engine meets the schema once too, untimed: the engines swap sides
    figures: dict[str, list[float]] = {"guided": [], "free": []}
    for i in range(rounds):
        a, b = (guided_core, free_core) if i % 2 == 0 else (free_core, guided_core)
        tok_s = step_interleaved({"guided": a, "free": b}, {"guided": guided, "free": free})
        for key in figures:
            figures[key].append(tok_s[key])
    best = {key: max(values) for key, values in figures.items()}
    return {
        "requests": n, "cold_tok_s": round(cold, 2),
        "guided_tok_s": round(best["guided"], 2), "free_tok_s": round(best["free"], 2),
        "ratio_guided_over_free": round(best["guided"] / best["free"], 3),
        "paired_ratio": paired_ratio(figures, "guided", "free"),
        "cold_over_free": round(cold / best["free"], 3),
        "tokens_per_request": statistics.mean(len(c.token_ids) for c in done),
        "stop_valid": _stop_valid(done), "rounds": {k: [round(v, 2) for v in vs] for k, vs in figures.items()},
    }


def run_guided_bench(model: str, batch: int, new_tokens: int, rounds: int) -> dict:
    torch.manual_seed(0)
    loaded = load_model(resolve_model(model), torch.float32, torch.device("cpu"))

    def core_for(seqs: int):
        # Speculation off: guided requests cannot speculate, and their free twins at batch 1 would, so the
        # ratio would mix the masks' cost with speculation's gain (`bench speculative` measures that).
        return lambda: EngineCore(EngineConfig(model=model, device="cpu", dtype="float32", max_num_seqs=seqs,
                                               speculative_tokens=0,
                                               max_num_batched_tokens=2048), loaded=loaded)

    results: dict = {"model": model, "new_tokens": new_tokens, "batch": batch, "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    guide_tokenizer(loaded.tokenizer, loaded.config.vocab_size)  # once per tokenizer, shared by the engines
    results["vocab_build_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    for label, seqs, n, schema in (("batch1_schema", 1, 4, PERSON), (f"batch{batch}_schema", batch, batch, PERSON),
                                   (f"batch{batch}_json_mode", batch, batch, JSON_MODE)):
        # A title of its own makes each section's schema new to the engines' caches, so `cold` is cold.
        results[label] = _compare(core_for(seqs), model, {**schema, "title": label}, n, new_tokens, rounds)
    return results
