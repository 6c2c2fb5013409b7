"""Experiment: does the small served model's surprise at a prompt help the learned router (held-out APGR)?

- Surprise: SmolLM2-135M-Instruct (the default model, through the project's loader, run as a transformers
  model on its weights by cli/bench/engine.hf_model) reads the prompt as the server would prefill it: the
  chat template over one user turn, at most MAX_TOKENS tokens. For each token of the user's text it gives
  the negative log-likelihood of that token and the entropy of the distribution that predicted it (one
  forward, no generation). The template's tokens before the text are the same for every prompt, so they are
  run once and their KV cache reused (checked against a whole forward); the template's closing tokens are
  not scored. Per-token values are cached (.cache/router_surprise.npz, by row of the data file), GSM8K
  first, then MMLU subjects in a fixed order until MMLU_BUDGET_TOKENS user tokens are reached.
- Features (fixed before any evaluation, none selected by results): the mean, deviation, max and 90th
  percentile of the NLL, log(1 + its sum) (a log scale, as the shipped sizes), the share of tokens with NLL
  above 5, the mean NLL over tokens holding a digit (0 when none does), and the mean entropy.
- Evaluation: the project's own held-out code (evaluation.held_out_scores over training.fit and
  linear.logits), the bench's folds (evaluation.folds over the whole file, so a subject keeps its fold),
  with the dense block widened: the shipped dense features, the surprise features twice (one copy for open
  requests, one for multiple-choice ones, as features.py doubles its sizes), then the bias last.
  linear.DENSE / WEIGHTS are patched to the new width and training.batch_of to return the widened batch;
  a variant drops features by zeroing their columns (a constant column is standardized to 0 and keeps a
  zero weight, linear._standardizer), so each variant is fitted by the same code.
- Variants: "shipped"; "shipped+surprise"; "surprise+length" (the surprise features, the two
  log_prompt_chars sizes, the choices flag); "length" (those sizes and the flag alone, fitted the same
  way; "length_chars" is the raw character count as the bench's length router). On the whole file (all
  MMLU) "shipped+surprise_open" adds the open copy only, which is zero on every multiple-choice row:
  GSM8K's figure beside the bench's. The other variants run on GSM8K and the scored MMLU subjects only
  (with 250k tokens, 16 of the 25 subjects, 3,107 rows: the greedy pass skips the long ones such as
  professional_law), each subject in its whole-file fold.
- Cost: wall time per prompt of the surprise forward at the prompts' median length (1 thread), and of the
  engine's own prefill with prompt_logprobs (what serving the feature would run) against a plain one.

Run (2-core VM, 1 thread):
  PYTHONPATH=. .venv/bin/python bench/experiments/router_surprise.py features   # cache per-token values
  PYTHONPATH=. .venv/bin/python bench/experiments/router_surprise.py evaluate --out \
      bench/experiments/router_surprise_results.json                           # figures (+ cost)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from loraplex.platform.routing.learned import evaluation, features, linear, metrics, training

MODEL = "smollm2-135m"
DATA = "../shared/router/routellm-dev.jsonl"
CACHE = ".cache/router_surprise.npz"
MAX_TOKENS = 512  # the prefilled sequence (template included) is cut here
MMLU_BUDGET_TOKENS = 250_000  # user tokens of MMLU scored (~25 min at ~6 ms a token, one thread)
SURPRISE_NAMES = ("nll_mean", "nll_std", "nll_max", "nll_p90", "nll_log_sum", "nll_share_over_5",
                  "nll_digit_mean", "entropy_mean")
K = 5
ROUNDS = 200  # the bench's bootstrap rounds
PAIRED_ROUNDS = 1000
SPLIT_SEEDS = (0, 1, 2, 3, 4)


# --- the model's view of a prompt ---------------------------------------------------------------------------

class Surprise:
    """Per-token NLL and entropy of a prompt's user text under the model, as the server would prefill it."""

    def __init__(self):
        from loraplex.cli.bench.engine import hf_model
        from loraplex.engine.models.loader import load_model, resolve_model

        self.loaded = load_model(resolve_model(MODEL), torch.float32, torch.device("cpu"))
        self.tok = self.loaded.tokenizer
        self.model = hf_model(self.loaded).eval()
        probe = "\x00PROMPT\x00"
        before, after = self.render(probe).split(probe)
        self.prefix = self.tok.encode(before, add_special_tokens=False)
        self.suffix = self.tok.encode(after, add_special_tokens=False)
        with torch.inference_mode():
            out = self.model(torch.tensor([self.prefix]), use_cache=True)
        self.cache = out.past_key_values
        self.first = out.logits[0, -1].float()  # predicts the text's first token
        texts = [self.tok.token_text(i) or "" for i in range(self.loaded.config.vocab_size)]
        self.digit = np.array([any(c.isdigit() for c in t) for t in texts])
        self.fallbacks = 0

    def render(self, prompt: str) -> str:
        return self.tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)

    def ids(self, prompt: str) -> list[int]:
        """The prefilled ids (template included), uncut."""
        return self.tok.encode(self.render(prompt), add_special_tokens=False)

    @staticmethod
    def _scores(logits: torch.Tensor, target: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
        nll = -logp.gather(1, target[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        return nll.numpy(), entropy.numpy()

    def whole(self, ids: list[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens start..end-1 of `ids` scored by one forward over ids[:end] (no cache)."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids[:end]])).logits[0]
        return self._scores(logits[start - 1:end - 1], torch.tensor(ids[start:end]))

    def score(self, prompt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(nll [n], entropy [n], digit [n] bool) over the user text's tokens within MAX_TOKENS."""
        ids = self.ids(prompt)
        p, s = len(self.prefix), len(self.suffix)
        end = min(MAX_TOKENS, len(ids) - s)
        if ids[:p] != self.prefix or ids[len(ids) - s:] != self.suffix:  # the text merged with the template
            self.fallbacks += 1
            nll, ent = self.whole(ids, p, end)
        else:
            text = ids[p:end]
            extra = self.cache.get_seq_length() - p
            if extra:
                self.cache.crop(-extra)
            with torch.inference_mode():
                out = self.model(torch.tensor([text]), cache=self.cache, use_cache=True)
            logits = torch.cat([self.first[None], out.logits[0, :-1].float()])
            nll, ent = self._scores(logits, torch.tensor(text))
        return nll, ent, self.digit[np.array(ids[p:end], np.int64)]


def read_rows(data: str) -> list[dict]:
    with open(data, "rb") as f:
        return [json.loads(line) for line in f if line.strip()]


def mmlu_order(rows: list[dict]) -> list[str]:
    """MMLU subjects in a fixed order unrelated to their labels: by the SHA-256 of their names."""
    return sorted({r["domain"] for r in rows if r["set"] == "mmlu"}, key=lambda d: hashlib.sha256(d.encode()).digest())


def load_cache(path: str) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    if not Path(path).exists():
        return {}
    with np.load(path) as z:
        cut = np.split(np.arange(len(z["nll"])), z["offsets"][1:-1])
        return {int(r): (z["nll"][c], z["entropy"][c], z["digit"][c]) for r, c in zip(z["rows"], cut, strict=True)}


def save_cache(path: str, cache: dict, meta: dict) -> None:
    rows = sorted(cache)
    lengths = [len(cache[r][0]) for r in rows]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, rows=np.array(rows, np.int64), offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
             nll=np.concatenate([cache[r][0] for r in rows]).astype(np.float32),
             entropy=np.concatenate([cache[r][1] for r in rows]).astype(np.float32),
             digit=np.concatenate([cache[r][2] for r in rows]), meta=np.array(json.dumps(meta)))
    Path(tmp).replace(path)


def compute(args) -> None:
    torch.set_num_threads(1)
    rows = read_rows(args.data)
    sur = Surprise()
    for i in range(3):  # the cached template prefix gives what a whole forward gives
        ids = sur.ids(rows[i]["prompt"])
        ref = sur.whole(ids, len(sur.prefix), min(MAX_TOKENS, len(ids) - len(sur.suffix)))[0]
        got = sur.score(rows[i]["prompt"])[0]
        assert np.abs(ref - got).max() < 1e-3, (i, np.abs(ref - got).max())
    cache = load_cache(args.cache)
    todo = [i for i, r in enumerate(rows) if r["set"] == "gsm8k"]
    budget, subjects = 0, []
    for subject in mmlu_order(rows):
        pick = [i for i, r in enumerate(rows) if r["domain"] == subject and r["set"] == "mmlu"]
        tokens = sum(min(MAX_TOKENS, len(sur.ids(rows[i]["prompt"])) - len(sur.suffix)) - len(sur.prefix)
                     for i in pick)
        if budget + tokens <= args.mmlu_budget:
            budget += tokens
            subjects.append(subject)
            todo += pick
    print(f"MMLU subjects scored ({budget} user tokens): {subjects}", flush=True)
    meta = {"model": MODEL, "max_tokens": MAX_TOKENS, "mmlu_subjects": subjects, "mmlu_tokens": budget}
    start, done, last = time.perf_counter(), 0, time.perf_counter()
    for i in todo:
        if i in cache:
            continue
        cache[i] = sur.score(rows[i]["prompt"])
        done += 1
        if time.perf_counter() - last > 60:
            save_cache(args.cache, cache, meta)
            last = time.perf_counter()
            print(f"{len(cache)}/{len(todo)} rows, {done / (last - start):.2f} rows/s", flush=True)
    meta["fallbacks"] = sur.fallbacks
    save_cache(args.cache, cache, meta)
    print(f"done: {len(cache)} rows in {time.perf_counter() - start:.0f} s, {sur.fallbacks} whole forwards")


# --- features and evaluation --------------------------------------------------------------------------------

def surprise_features(nll: np.ndarray, ent: np.ndarray, digit: np.ndarray) -> np.ndarray:
    """[len(SURPRISE_NAMES)] (module docstring)."""
    return np.array([nll.mean(), nll.std(), nll.max(), np.percentile(nll, 90), np.log1p(nll.sum()),
                     (nll > 5).mean(), nll[digit].mean() if digit.any() else 0.0, ent.mean()], np.float32)


@contextlib.contextmanager
def widened(batch: linear.Batch, fold: np.ndarray):
    """linear's dense block as wide as `batch`'s; training.batch_of gives `batch`, evaluation.folds `fold`."""
    saved = (linear.DENSE, linear.WEIGHTS, training.batch_of, evaluation.folds)
    width = batch.dense.shape[1]
    linear.DENSE, linear.WEIGHTS = width, width
    training.batch_of = lambda examples: batch
    evaluation.folds = lambda examples, k: fold
    try:
        yield
    finally:
        linear.DENSE, linear.WEIGHTS, training.batch_of, evaluation.folds = saved


def layout(base: np.ndarray, sur: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """[N, DENSE + 2 S] the shipped dense features (bias apart), the surprise features for open and for
    multiple-choice requests, the bias last; and the column names."""
    choices = base[:, features.DENSE_NAMES.index("choices")] > 0.5
    dense = np.concatenate([base[:, :-1], sur * ~choices[:, None], sur * choices[:, None], base[:, -1:]], axis=1)
    names = [*features.DENSE_NAMES[:-1], *(f"open:{n}" for n in SURPRISE_NAMES),
             *(f"choices:{n}" for n in SURPRISE_NAMES), "bias"]
    return dense.astype(np.float32), names


def keep_columns(names: list[str], variant: str) -> np.ndarray:
    shipped = set(features.DENSE_NAMES)
    open_s = {f"open:{n}" for n in SURPRISE_NAMES}
    all_s = open_s | {f"choices:{n}" for n in SURPRISE_NAMES}
    keep = {"shipped": shipped, "shipped+surprise": shipped | all_s, "shipped+surprise_open": shipped | open_s,
            "surprise+length": all_s | {"log_prompt_chars", "choices:log_prompt_chars", "choices", "bias"},
            "length": {"log_prompt_chars", "choices:log_prompt_chars", "choices", "bias"}}[variant]
    return np.array([n in keep for n in names])


def held_out(examples: list, dense: np.ndarray, names: list[str], variant: str, fold: np.ndarray) -> np.ndarray:
    d = dense * keep_columns(names, variant)
    batch = linear.Batch(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), d)
    with widened(batch, fold):
        return evaluation.held_out_scores(examples, K)


def paired_delta(a: np.ndarray, b: np.ndarray, weak: np.ndarray, strong: np.ndarray) -> dict:
    """APGR(b) - APGR(a) with a 95% interval over the same resampled prompts."""
    rng = np.random.default_rng(0)
    draws = []
    for _ in range(PAIRED_ROUNDS):
        pick = rng.integers(0, len(a), len(a))
        draws.append(metrics.apgr(b[pick], weak[pick], strong[pick]) - metrics.apgr(a[pick], weak[pick], strong[pick]))
    return {"value": round(metrics.apgr(b, weak, strong) - metrics.apgr(a, weak, strong), 4),
            "ci95": [round(float(np.percentile(draws, q)), 4) for q in (2.5, 97.5)]}


def per_set(examples: list, scores: dict[str, np.ndarray], base: str = "shipped") -> dict:
    weak = np.array([e.weak_correct for e in examples], np.float64)
    strong = np.array([e.strong_correct for e in examples], np.float64)
    sets = np.array([e.set for e in examples])
    out = {}
    for name in sorted(set(sets)):
        pick = sets == name
        out[name] = {"examples": int(pick.sum()), "routers": {}}
        for variant, s in scores.items():
            fig = evaluation._figures(s[pick], weak[pick], strong[pick], ROUNDS)
            if variant != base:
                fig["apgr_minus_" + base] = paired_delta(scores[base][pick], s[pick], weak[pick], strong[pick])
            out[name]["routers"][variant] = fig
    return out


def gsm8k_splits(examples: list, fold: np.ndarray, seed: int) -> np.ndarray:
    """The bench's folds with GSM8K's problems dealt at random (seeded) instead of by their hash."""
    out = fold.copy()
    g = np.flatnonzero([e.set == "gsm8k" for e in examples])
    out[g] = np.random.default_rng(seed).permutation(len(g)) % K
    return out


def evaluate(args) -> dict:
    rows = read_rows(args.data)
    with open(args.data, "rb") as stream:
        examples = training.read_examples(stream)
    assert len(rows) == len(examples) and all(r["prompt"] == e.request.last_user for r, e in zip(rows, examples,
                                                                                                  strict=True))
    cache = load_cache(args.cache)
    with np.load(args.cache) as z:
        meta = json.loads(str(z["meta"]))
    have = np.array([i in cache for i in range(len(rows))])
    sur = np.zeros((len(rows), len(SURPRISE_NAMES)), np.float32)
    for i, v in cache.items():
        sur[i] = surprise_features(*v)
    base = training.batch_of(examples).dense
    dense, names = layout(base, sur)
    fold = evaluation.folds(examples, K)  # the bench's folds, over the whole file
    choices = base[:, features.DENSE_NAMES.index("choices")] > 0.5
    is_gsm = np.array([e.set == "gsm8k" for e in examples])
    assert have[is_gsm].all() and not (~choices & ~is_gsm & ~have).any(), "open MMLU rows need their surprise"
    result: dict = {"data": args.data, "model": MODEL, "max_tokens": MAX_TOKENS, "surprise_features": SURPRISE_NAMES,
                    "folds": K, "bootstrap_rounds": ROUNDS, "paired_rounds": PAIRED_ROUNDS,
                    "mmlu_subjects_scored": meta["mmlu_subjects"], "template_fallbacks": meta.get("fallbacks")}
    # sanity: the widened path with the surprise columns zeroed is the bench's own held_out_scores
    bench = evaluation.held_out_scores(examples, K)
    shipped = held_out(examples, dense, names, "shipped", fold)
    result["widened_shipped_matches_bench"] = float(np.abs(bench - shipped).max())
    print("widened shipped vs bench: max |logit diff|", result["widened_shipped_matches_bench"], flush=True)

    # 1. the whole file: GSM8K with the open copy of the surprise features (zero on multiple-choice rows)
    whole = {v: held_out(examples, dense, names, v, fold) for v in ("shipped+surprise_open",)}
    whole = {"shipped": shipped, **whole, "length_chars": np.array([float(e.request.prompt_chars) for e in examples])}
    result["whole_file"] = per_set(examples, whole)
    print(json.dumps({s: {v: f["apgr"] for v, f in d["routers"].items()} for s, d in result["whole_file"].items()}),
          flush=True)

    # 2. GSM8K and the scored MMLU subjects, every variant
    sub = [e for e, h in zip(examples, have, strict=True) if h]
    variants = ("shipped", "shipped+surprise", "surprise+length", "length")
    scores = {v: held_out(sub, dense[have], names, v, fold[have]) for v in variants}
    result["scored_subset"] = per_set(sub, scores)
    print(json.dumps({s: {v: f["apgr"] for v, f in d["routers"].items()}
                      for s, d in result["scored_subset"].items()}), flush=True)

    # 3. GSM8K over five random splits of its problems (MMLU folds as the bench's)
    weak = np.array([e.weak_correct for e in examples], np.float64)
    strong = np.array([e.strong_correct for e in examples], np.float64)
    splits: dict = {}
    for seed in SPLIT_SEEDS:
        f = gsm8k_splits(examples, fold, seed)
        for v in ("shipped", "shipped+surprise_open", "surprise+length", "length"):
            s = held_out(examples, dense, names, v, f)
            splits.setdefault(v, []).append(round(metrics.apgr(s[is_gsm], weak[is_gsm], strong[is_gsm]), 4))
    result["gsm8k_random_splits"] = {v: {"apgr": a, "mean": round(statistics.mean(a), 4)} for v, a in splits.items()}
    print(json.dumps(result["gsm8k_random_splits"]), flush=True)

    # 4. each surprise feature alone as a score (higher = strong), no sign chosen, over the scored rows (pooled
    # over subjects): descriptive only; beside the prompt's length in characters and in user tokens
    alone = {}
    for set_name in ("gsm8k", "mmlu"):
        pick = have & np.array([e.set == set_name for e in examples])
        alone[set_name] = {n: round(metrics.apgr(sur[pick, j], weak[pick], strong[pick]), 4)
                           for j, n in enumerate(SURPRISE_NAMES)}
        tokens = np.array([len(cache[i][0]) if i in cache else 0 for i in range(len(rows))], np.float64)
        chars = np.array([float(e.request.prompt_chars) for e in examples])
        for n, v in (("(length_chars)", chars), ("(user_tokens)", tokens)):
            alone[set_name][n] = round(metrics.apgr(v[pick], weak[pick], strong[pick]), 4)
    result["feature_alone_apgr"] = alone
    # the fitted weights of shipped+surprise_open on all rows (standardized effect = raw weight * deviation)
    d = dense * keep_columns(names, "shipped+surprise_open")
    batch = linear.Batch(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), d)
    with widened(batch, fold):
        w = training.fit(batch, examples)
    dev = d.std(axis=0)
    result["weights_standardized_open_surprise"] = {
        n: round(float(w[j] * dev[j]), 4) for j, n in enumerate(names) if n.startswith("open:")}
    return result


# --- cost ---------------------------------------------------------------------------------------------------

def engine_agreement(core, sur: Surprise, prompt: str) -> float:
    """The largest gap between the engine's prompt log-probabilities of the user text's tokens and the
    NLLs the experiment uses (the server would compute the same numbers)."""
    from loraplex.engine.api import GenerateRequest, SamplingParams

    core.add_request(GenerateRequest("agree", MODEL, messages=({"role": "user", "content": prompt},),
                                     sampling=SamplingParams(max_tokens=0, prompt_logprobs=0)))
    entries: list = []
    while core.has_work():
        for ev in core.step():
            entries.extend(ev.prompt_logprobs)
    nll = sur.score(prompt)[0]
    p = len(sur.prefix)
    engine = -np.array([e.logprob for e in entries[p:p + len(nll)]], np.float64)
    return round(float(np.abs(engine - nll).max()), 5)


def cost(args) -> dict:
    """Per-prompt wall time at the prompts' median prefilled length, one thread."""
    from loraplex.engine.api import GenerateRequest, SamplingParams
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.core import EngineCore

    torch.set_num_threads(1)
    rows = read_rows(args.data)
    sur = Surprise()
    lengths = {i: len(sur.ids(r["prompt"])) for i, r in enumerate(rows)}
    out: dict = {"threads": 1, "cpu": "this VM (2 shared cores)", "load_average_before": os.getloadavg()}
    for name, pick in (("gsm8k", [i for i in lengths if rows[i]["set"] == "gsm8k"]),
                       ("mmlu", [i for i in lengths if rows[i]["set"] == "mmlu"])):
        median = int(np.median([lengths[i] for i in pick]))
        near = sorted(pick, key=lambda i: (abs(lengths[i] - median), i))[:args.cost_prompts]
        prompts = [rows[i]["prompt"] for i in near]
        times: dict[str, list[float]] = {"surprise_forward_whole": [], "surprise_forward_prefix_cached": []}
        for p in prompts:
            ids = sur.ids(p)
            start = time.perf_counter()
            sur.whole(ids, len(sur.prefix), min(MAX_TOKENS, len(ids) - len(sur.suffix)))
            times["surprise_forward_whole"].append(time.perf_counter() - start)
            start = time.perf_counter()
            sur.score(p)
            times["surprise_forward_prefix_cached"].append(time.perf_counter() - start)
        cfg = EngineConfig(model=MODEL, device="cpu", dtype="float32", num_threads=1, speculative_tokens=0,
                           max_num_batched_tokens=MAX_TOKENS, enable_prefix_caching=False,
                           kv_cache_bytes=256 * 2**20)
        core = EngineCore(cfg, loaded=sur.loaded)
        out.setdefault("engine_nll_max_abs_diff", {})[name] = engine_agreement(core, sur, prompts[0])
        for label, sampling in (("engine_prefill_prompt_logprobs", SamplingParams(max_tokens=0, prompt_logprobs=0)),
                                ("engine_prefill_plain_1_token", SamplingParams(max_tokens=1, temperature=0.0))):
            times[label] = []
            for j, p in enumerate([prompts[0], *prompts]):  # the first is a warm-up
                req = GenerateRequest(f"{label}-{j}", MODEL, messages=({"role": "user", "content": p},),
                                      sampling=sampling)
                start = time.perf_counter()
                core.run([req])
                if j:
                    times[label].append(time.perf_counter() - start)
        out[name] = {"median_prefilled_tokens": median, "prompts_timed": len(prompts),
                     "mean_prefilled_tokens_timed": round(float(np.mean([lengths[i] for i in near])), 1),
                     **{k: {"p50_ms": round(1000 * statistics.median(v), 1)} for k, v in times.items()}}
        print(json.dumps({name: out[name]}), flush=True)
    out["load_average_after"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("features", "evaluate", "cost"))
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--cache", default=CACHE)
    ap.add_argument("--mmlu-budget", type=int, default=MMLU_BUDGET_TOKENS)
    ap.add_argument("--cost-prompts", type=int, default=20)
    ap.add_argument("--no-cost", action="store_true", help="evaluate without timing the forward")
    ap.add_argument("--out", help="write the figures (JSON) here")
    args = ap.parse_args()
    if args.stage == "features":
        compute(args)
        return
    result = evaluate(args) if args.stage == "evaluate" else {}
    if args.stage == "cost" or not args.no_cost:
        result["cost"] = cost(args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
