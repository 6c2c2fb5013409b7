"""Engine throughput against HF transformers `generate` on the same weights, in one run.

Both systems get the same prompts, greedy decoding and exactly `new_tokens` new tokens per request
(EOS ignored), at batch 1 (prompts one after another) and at batch N (all at once), on one device and
dtype (--device, --dtype; HF runs on the same). The same run measures that device's roofline: batch 1 is
bound by reading every weight once per step, batch N by the GEMM rate over the FLOPs of one generated token.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.cli.bench import roofline
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.models.llama import LlamaConfig
from loraplex.engine.models.loader import LoadedModel, load_model, resolve_model


@dataclass(frozen=True)
class BenchTarget:
    """Where a benchmark's engines and baselines run (--device, --dtype, --attention-backend), checked
    before anything loads so a bad flag costs one line, not a model load."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str = "auto"

    @classmethod
    def parse(cls, device: str = "auto", dtype: str = "auto", attention_backend: str = "auto") -> BenchTarget:
        dev = roofline.resolve_device(device)
        target = cls(dev, roofline.resolve_dtype(dtype, dev), attention_backend)
        EngineConfig(**target.config_kwargs())  # refuses an unknown attention backend
        return target

    def config_kwargs(self) -> dict[str, str]:
        """EngineConfig's device, dtype and attention_backend fields."""
        return {"device": str(self.device), "dtype": roofline.dtype_name(self.dtype),
                "attention_backend": self.attention_backend}

    def load(self, model: str) -> LoadedModel:
        """The model's weights on this device at this dtype."""
        return load_model(resolve_model(model), self.dtype, self.device)

    def describe(self, core: EngineCore) -> dict:
        """The JSON's "machine": device and its name, dtype, the attention backend asked for and the one `core`
        runs ("auto" resolved), torch and triton versions."""
        return {**roofline.machine(self.device, self.dtype), "attention_backend": self.attention_backend,
                "attention_backend_used": core.runner.model.attention.name}


TOPICS = [
    "the history of the printing press", "how rainbows form", "a lighthouse keeper's day",
    "the rules of chess", "why the sky is blue", "training for a marathon", "the life of bees",
    "building a wooden boat", "the water cycle", "a trip to the mountains", "how compilers work",
    "the first moon landing", "growing tomatoes", "the origin of jazz", "volcanoes", "black holes",
]


def bench_prompts(n: int) -> list[str]:
    """Deterministic prompts of varied length."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        extra = " Please be detailed and precise, and use simple words." * (i % 3)
        out.append(f"Write a short essay about {topic}.{extra} Begin with an introduction.")
    return out


def flops_per_token(cfg: LlamaConfig, context: int) -> float:
    """Matmul FLOPs of one generated token: every linear layer, the LM head, and attention
    over `context` earlier tokens (QK^T and PV)."""
    per_layer = (cfg.q_size + 2 * cfg.kv_size) * cfg.hidden_size + cfg.hidden_size * cfg.q_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    attn = 2 * cfg.num_heads * cfg.head_dim * context
    return 2.0 * (cfg.num_layers * (per_layer + attn) + cfg.vocab_size * cfg.hidden_size)


def hf_model(loaded: LoadedModel, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """A transformers LlamaForCausalLM holding our (unfused) weights on `device` at `dtype` (None: the
    loaded weights' own), for the HF baselines.

    Built on the meta device and given our tensors (views of the fused ones, or one converted copy each when
    the device or dtype differs) with load_state_dict(assign=True): no second copy of the model is made,
    nor random initial weights. The rotary embedding's computed buffers are rebuilt on the device."""
    import transformers

    c, w = loaded.config, loaded.weights
    device = w["embed"].device if device is None else torch.device(device)
    dtype = w["embed"].dtype if dtype is None else dtype
    hc = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias, torch_dtype=roofline.dtype_name(dtype))
    sd = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"]}
    sd["lm_head.weight"] = w["embed"] if c.tie_word_embeddings else w["lm_head"]
    for i in range(c.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        gate, up = w[q + "gate_up"].chunk(2)
        sd.update({
            p + "input_layernorm.weight": w[q + "input_norm"],
            p + "post_attention_layernorm.weight": w[q + "post_norm"],
            p + "self_attn.o_proj.weight": w[q + "o"],
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": w[q + "down"],
        })
        for kind in ("weight", "bias") if c.attention_bias else ("weight",):  # fused qkv rows are q, k, v
            fused = w[q + ("qkv" if kind == "weight" else "qkv_bias")]
            for name, part in zip("qkv", fused.split([c.q_size, c.kv_size, c.kv_size]), strict=True):
                sd[f"{p}self_attn.{name}_proj.{kind}"] = part
        if c.attention_bias:  # HF's Llama gives o_proj a bias too; Qwen2's (ours) is zero
            sd[p + "self_attn.o_proj.bias"] = torch.zeros(c.hidden_size, dtype=dtype, device=device)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hc)
    moved: dict[int, torch.Tensor] = {}  # one copy of a tensor named twice (tied embeddings), if one is needed
    for key, t in sd.items():
        sd[key] = moved[id(t)] if id(t) in moved else moved.setdefault(id(t), t.to(device=device, dtype=dtype))
    model.load_state_dict(sd, strict=False, assign=True)
    for name, module in list(model.named_modules()):  # non-persistent buffers (rotary inv_freq): computed
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, type(module)(config=hc).to(device))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"hf_model: no weights for {left[:3]}")
    return model.eval()


def interleaved_rounds(rounds: int, runs: dict[str, Callable[[], Any]]) -> dict[str, list]:
    """Each named run's results (numbers rounded to 2 places), the runs taking turns `rounds` times
    so drift in a shared machine's speed touches every side alike; a caller reports each run's best
    round (noise only ever slows a run)."""
    figures: dict[str, list] = {name: [] for name in runs}
    for _ in range(max(rounds, 1)):
        for name, run in runs.items():
            result = run()
            figures[name].append(round(result, 2) if isinstance(result, float) else result)
    return figures


def step_interleaved(cores: dict[str, EngineCore], requests: dict[str, list[GenerateRequest]],
                     on_events: Callable[[str, list], None] | None = None) -> dict[str, float]:
    """Each named core's tok/s over its own requests, the cores taking turns step by step: tokens over
    the time spent in that core's steps. A step is tens of milliseconds and a shared machine's slow
    phases last seconds, so every core's steps meet the same phases; whole runs taking turns (as
    interleaved_rounds does) leave a phase to one side. All requests are checked before any is added;
    on_events(name, events) sees each step's events, outside the timed part."""
    prepared = {name: [cores[name].prepare(r) for r in reqs] for name, reqs in requests.items()}
    for name, reqs in prepared.items():
        for r in reqs:
            cores[name].add(r)
    busy = dict.fromkeys(cores, 0.0)
    tokens = dict.fromkeys(cores, 0)
    while any(core.has_work() for core in cores.values()):
        for name, core in cores.items():
            if core.has_work():
                device = core.config.torch_device
                t0 = roofline.clock(device)
                events = core.step()
                busy[name] += roofline.clock(device) - t0
                tokens[name] += sum(len(ev.token_ids) for ev in events)
                if on_events is not None:
                    on_events(name, events)
    return {name: tokens[name] / busy[name] if busy[name] else 0.0 for name in cores}


def paired_ratio(figures: dict[str, list], name: str, base: str) -> float:
    """The median over rounds of `name`'s figure over `base`'s in the same round. The runs of one
    round are adjacent in time, so a slow phase of a shared machine tends to touch both sides of each
    ratio; the ratio of best rounds can pair a base round of a fast phase with a run that never met
    one. Reported beside the best-round ratio, not instead of it."""
    ratios = [a / b for a, b in zip(figures[name], figures[base], strict=True) if b]
    return round(statistics.median(ratios), 3) if ratios else float("nan")


def _ours(core: EngineCore, prompts: list[str], new_tokens: int, batch: int, model: str) -> float:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(f"b{i}", model, prompt=p, sampling=sp) for i, p in enumerate(prompts)]
    device = core.config.torch_device
    t0 = roofline.clock(device)
    generated = 0
    for i in range(0, len(reqs), batch):
        generated += sum(len(c.token_ids) for c in core.run(reqs[i:i + batch]))
    return generated / (roofline.clock(device) - t0)


def left_padded(tokenizer, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, width) of the prompts, left-padded with 0, on `device`: HF generate's input."""
    encoded = [tokenizer.encode(p) for p in prompts]
    width = max(len(e) for e in encoded)
    ids = torch.tensor([[0] * (width - len(e)) + e for e in encoded], device=device)  # [batch, width]
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
    return ids, mask, width


@torch.inference_mode()
def _hf(model, tokenizer, prompts: list[str], new_tokens: int, batch: int) -> float:
    t0 = roofline.clock(model.device)
    generated = 0
    for i in range(0, len(prompts), batch):
        ids, mask, width = left_padded(tokenizer, prompts[i:i + batch], model.device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        generated += (out.shape[1] - width) * out.shape[0]
    return generated / (roofline.clock(model.device) - t0)


def run_engine_bench(model: str, new_tokens: int, batch1_prompts: int, batch: int, skip_hf: bool = False,
                     rounds: int = 3, device: str = "auto", dtype: str = "auto",
                     attention_backend: str = "auto") -> dict:
    target = BenchTarget.parse(device, dtype, attention_backend)
    torch.manual_seed(0)
    loaded = target.load(model)
    # Speculation off: the roofline and HF are one token per pass over the weights (`bench speculative`
    # measures speculation against this plain path).
    core = EngineCore(EngineConfig(model=model, max_num_seqs=max(batch, 1), speculative_tokens=0,
                                   max_num_batched_tokens=2048, **target.config_kwargs()), loaded=loaded)
    cfg = loaded.config
    weight_bytes = core.runner.model.weight_bytes()
    prompts1 = bench_prompts(batch1_prompts)
    prompts_n = bench_prompts(batch)
    avg_prompt = sum(len(loaded.tokenizer.encode(p)) for p in prompts_n) / len(prompts_n)
    hf = None if skip_hf else hf_model(loaded, target.device, target.dtype)
    _ours(core, prompts1[:1], 8, 1, model)  # warm-up
    if hf is not None:
        _hf(hf, loaded.tokenizer, prompts1[:1], 8, 1)
    # the roofline takes its turn too, and its best round counts like the others'
    runs: dict[str, Callable[[], Any]] = {"roofline": lambda: roofline.measure(target.device, target.dtype)}
    for key, prompts, b in (("batch1", prompts1, 1), (f"batch{batch}", prompts_n, batch)):
        runs[f"{key}.ours"] = lambda p=prompts, b=b: _ours(core, p, new_tokens, b, model)
        if hf is not None:
            runs[f"{key}.hf"] = lambda p=prompts, b=b: _hf(hf, loaded.tokenizer, p, new_tokens, b)
    runs = interleaved_rounds(rounds, runs)
    roofs = runs.pop("roofline")
    roof = {k: max(r[k] for r in roofs) for k in roofs[0]}
    results = {
        "machine": target.describe(core),
        "model": model, "dtype": roofline.dtype_name(target.dtype), "new_tokens": new_tokens,
        "weight_bytes": weight_bytes,
        "roofline": roof,
        "rounds": runs,
        "batch1": {"roofline_tok_s": round(roof["mem_read_gbs"] * 1e9 / weight_bytes, 2)},
        f"batch{batch}": {"roofline_tok_s": round(roof["gemm_gflops"] * 1e9
                                                  / flops_per_token(cfg, int(avg_prompt + new_tokens / 2)), 2)},
    }
    for name, figures in runs.items():
        key, system = name.split(".")
        results[key][f"{system}_tok_s"] = max(figures)
    for key in ("batch1", f"batch{batch}"):
        r = results[key]
        r["fraction_of_roofline"] = round(r["ours_tok_s"] / r["roofline_tok_s"], 3)
        if "hf_tok_s" in r:
            r["speedup_vs_hf"] = round(r["ours_tok_s"] / r["hf_tok_s"], 2)
    return results
