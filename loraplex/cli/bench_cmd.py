"""`loraplex bench <name> --json PATH`: benchmarks that compare side by side in one run.

Each benchmark lives in `loraplex/cli/bench/<module>.py` as `run_<name>_bench(**options)`; this
module only declares its options. A benchmark's module is imported when it runs (they pull in
transformers, peft or a web server).
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"

# Where a benchmark runs (bench/roofline.py's rules; checked when it runs, not here, so the CLI starts without torch).
DEVICE_OPTIONS: list[tuple[str, dict]] = [
    ("--device", {"default": "auto", "help": "auto (cuda when present, else cpu), cpu, cuda or cuda:N"}),
    ("--dtype", {"default": "auto", "choices": ["auto", "float32", "bfloat16", "float16"],
                 "help": "auto: bfloat16 on CUDA, float32 on the CPU (as EngineConfig.dtype)"}),
]
ENGINE_DEVICE_OPTIONS = [*DEVICE_OPTIONS, ("--attention-backend", {
    "default": "auto", "help": "auto, torch_sdpa, cpu_c or triton_paged (EngineConfig.attention_backend)"})]

# The help of options several benchmarks share, where their own entry gives none
SHARED_HELP = {
    "--model": "the base model (default %(default)s)",
    "--new-tokens": "tokens generated per request (default %(default)s)",
    "--batch": "requests decoded together (default %(default)s)",
    "--rank": "the adapters' LoRA rank (default %(default)s)",
    "--requests": "requests sent (default %(default)s)",
    "--rounds": "rounds, taking turns (default %(default)s)",
    "--seconds": "seconds of load (default %(default)s)",
}

# name -> (module, help, [(flag, kwargs)]); every benchmark also takes --json PATH.
BENCHMARKS: dict[str, tuple[str, str, list[tuple[str, dict]]]] = {
    "engine": ("engine", "engine tokens/s vs HF transformers, with the machine's roofline", [
        ("--model", {"default": DEFAULT_MODEL}),
        ("--new-tokens", {"type": int, "default": 64}),
        ("--batch1-prompts", {"type": int, "default": 3, "help": "prompts run one at a time at batch 1"}),
        ("--batch", {"type": int, "default": 32}),
        ("--skip-hf", {"action": "store_true", "help": "measure our engine only"}),
        ("--rounds", {"type": int, "default": 3,
                      "help": "interleaved rounds; each system's best round counts (a shared VM's noise only slows)"}),
        *ENGINE_DEVICE_OPTIONS,
    ]),
    "lora": ("lora", "multi-LoRA tokens/s (identical, zipf, distinct, zipf in a rank-64 fleet, zipf and distinct "
                     "on bf16 slots) vs base and HF PEFT", [
        ("--model", {"default": DEFAULT_MODEL}),
        ("--batch", {"type": int, "default": 32}),
        ("--rank", {"type": int, "default": 16}),
        ("--new-tokens", {"type": int, "default": 64}),
        ("--peft-new-tokens", {"type": int, "default": None,
                               "help": "tokens per request for HF PEFT (default: --new-tokens). Fewer keep the "
                                       "run short but flatter the ratio: PEFT's prefill weighs more per token"}),
        ("--skip-peft", {"action": "store_true", "help": "measure our engine only, not HF PEFT"}),
        ("--rounds", {"type": int, "default": 3,
                      "help": "rounds, each with the patterns' engines taking turns step by step, then "
                              "HF PEFT's batch; all count"}),
        *ENGINE_DEVICE_OPTIONS,
    ]),
    "kernels": ("kernels", "Triton SGMV/BGMV LoRA and paged-attention kernels vs the torch path on the same inputs, "
                           "with errors against the references and decode attention's GB/s against the device's", [
        *DEVICE_OPTIONS,
        ("--quick", {"action": "store_true",
                     "help": "tiny shapes (a smoke run; the only size on the CPU, under TRITON_INTERPRET=1)"}),
    ]),
    "quant": ("quant", "one model at fp32, bf16, int8, int4 and its GGUF's own blocks (--weight-dtype): tokens/s at "
                       "each batch, perplexity, greedy agreement with fp32, resident memory, batch 1 against the "
                       "memory roofline", [
        ("--model", {"default": DEFAULT_MODEL}),
        ("--new-tokens", {"type": int, "default": 64}),
        ("--batches", {"default": "1,8,32", "help": "batch sizes, comma-separated"}),
        ("--rounds", {"type": int, "default": 3,
                      "help": "rounds, each with every engine taking turns step by step at every batch size"}),
        ("--formats", {"default": "fp32,bf16,int8,int4,gguf",
                       "help": "formats to compare, comma-separated (fp32 always; gguf only for a GGUF model); "
                               "int8_a8, int4_a8, gguf_a8: those blocks with --activation-dtype int8"}),
        ("--llama-cpp", {"action": "store_true",
                         "help": "llama.cpp on the same GGUF in the same rounds (needs llama_cpp importable)"}),
    ]),
    "kv": ("kv", "KV cache dtypes (--kv-cache-dtype) vs an fp32 cache: tokens/s at each batch, agreement of greedy "
                 "tokens, perplexity, block bytes", [
        ("--model", {"default": DEFAULT_MODEL}),
        ("--new-tokens", {"type": int, "default": 64}),
        ("--batches", {"default": "1,32", "help": "batch sizes, comma-separated"}),
        ("--kv-cache-dtypes", {"default": "float32,int8,bfloat16,float16,fp8",
                               "help": "cache dtypes, comma-separated (float32, the base, always runs)"}),
        ("--kv-cache-mb", {"type": int, "default": 1024, "help": "each engine's KV cache"}),
        ("--decode-contexts", {"default": "256,512",
                               "help": "context lengths of the decode-step figures at the largest batch, "
                                       "comma-separated ('' for none)"}),
        ("--decode-reps", {"type": int, "default": 20, "help": "decode steps per engine and context, in turns"}),
        ("--rounds", {"type": int, "default": 3,
                      "help": "rounds, each with the engines taking turns step by step at every batch size"}),
    ]),
    "gateway": ("gateway", "latency the platform adds (auth, limits, routing, usage) and its max rps", [
        ("--database-url", {"default": "postgresql://postgres@localhost:5432/postgres",
                            "help": "Postgres server for a scratch database (dropped after); 'sqlite' for embedded"}),
        ("--redis-url", {"default": "redis://localhost:6379/0", "help": "'none' for in-process counters"}),
        ("--rate", {"type": float, "default": 200.0, "help": "open-loop requests/s for the latency figures"}),
        ("--seconds", {"type": float, "default": 10.0}),
        ("--concurrency", {"type": int, "default": 32, "help": "connections for the max_rps run"}),
        ("--tokens", {"type": int, "default": 16, "help": "tokens the fake engine returns per request"}),
        ("--auto", {"action": "store_true",
                    "help": "also measure `model: auto` over a pool of three models, beside the named model"}),
    ]),
    "prefix": ("scheduling", "TTFT with a shared system prompt, and n choices of one prompt at once, cache on vs off", [
        ("--model", {"default": DEFAULT_MODEL}),
        ("--requests", {"type": int, "default": 32}),
        ("--system-tokens", {"type": int, "default": 500, "help": "tokens of the shared system prompt"}),
        ("--question-tokens", {"type": int, "default": 50, "help": "tokens of each request's own question"}),
        ("--choices", {"type": int, "default": 8, "help": "requests of one prompt sent at once (n choices)"}),
        ("--choice-prompt-tokens", {"type": int, "default": 200,
                                  "help": "tokens of the prompt the n choices share"}),
    ]),
    "priority": ("scheduling", "realtime TTFT under batch load, priority classes vs FCFS", [
        ("--model", {"default": DEFAULT_MODEL}),
        ("--max-num-seqs", {"type": int, "default": 8, "help": "requests the engine runs at once"}),
        ("--batch-tokens", {"type": int, "default": 96, "help": "tokens each batch-class request generates"}),
        ("--realtime-requests", {"type": int, "default": 8,
                               "help": "realtime requests sent under the batch load"}),
        ("--interval", {"type": float, "default": 0.5, "help": "seconds between realtime requests"}),
    ]),
    "multiplex": ("multiplex", "model load times per tier, alternating two models vs one", [
        ("--requests", {"type": int, "default": 8}),
        ("--new-tokens", {"type": int, "default": 32}),
    ]),
    "speculative": ("speculative", "n-gram speculative decoding vs plain greedy decoding, quoting and free text", [
        ("--model", {"default": DEFAULT_MODEL}),
        ("--tokens", {"type": int, "default": 4, "help": "draft tokens per step"}),
        ("--new-tokens", {"type": int, "default": 128}),
        ("--rounds", {"type": int, "default": 3}),
    ]),
    "router": ("router", "`auto`'s learned scorer, cross-validated with whole subjects held out: APGR and the "
                         "strong-call share for 50%/80% of the gap vs length-only and random routing", [
        ("--data", {"required": True,
                    "help": "JSON lines: {prompt|messages, weak_correct, strong_correct, set, domain}"}),
        ("--folds", {"type": int, "default": 5, "help": "cross-validation folds (whole subjects held out)"}),
        ("--bootstrap", {"type": int, "default": 200, "help": "bootstrap rounds for the 95% intervals"}),
        ("--weights", {"default": None, "help": "weights whose scoring time to measure (default: the shipped ones)"}),
    ]),
    "fleet": ("fleet", "adapter-affinity routing vs Serve's default routing over a Ray Serve deployment of engine "
                       "replicas, and the Serve hop's cost against an engine in process", [
        ("--model", {"default": DEFAULT_MODEL}),
        ("--replicas", {"type": int, "default": 2, "help": "engine replicas deployed"}),
        ("--threads", {"type": int, "default": None,
                       "help": "threads per replica (default: this machine's cores shared among the replicas)"}),
        ("--adapters", {"type": int, "default": 24, "help": "synthetic adapters registered"}),
        ("--rank", {"type": int, "default": 16}),
        ("--requests", {"type": int, "default": 96, "help": "per turn, for adapters picked uniformly at random"}),
        ("--concurrency", {"type": int, "default": 16, "help": "requests in flight (default: twice the slots)"}),
        ("--new-tokens", {"type": int, "default": 32}),
        ("--max-loras", {"type": int, "default": 4, "help": "device slots per replica"}),
        ("--max-cpu-loras", {"type": int, "default": 12,
                             "help": "CPU tier per replica (default: half the adapters, a replica's share)"}),
        ("--rounds", {"type": int, "default": 3,
                      "help": "turns of each policy, taking turns; each turn deploys the replicas afresh"}),
        ("--popularity", {"default": "uniform", "help": "how requests pick adapters: uniform, or zipf:<s>"}),
        ("--hop-requests", {"type": int, "default": 100,
                            "help": "requests timing the Serve hop against the same model in process (0: skip)"}),
    ]),
    "blocks": ("blocks", "the CPU's packed GEMM over GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) vs the same "
                         "values in fp32 and bf16 panels, and over int8 activations, at a few "
                         "rows", [
        ("--formats", {"default": "q4_k,q5_k,q6_k,q4_1", "help": "block formats, comma-separated"}),
        ("--rows", {"default": "1,8", "help": "rows per call (a decode step's sequences), comma-separated"}),
        ("--repeats", {"type": int, "default": 7, "help": "turns of the three panels; each one's best counts"}),
        ("--calls", {"type": int, "default": 20, "help": "calls timed per turn"}),
        ("--shapes", {"default": "full", "choices": ["full", "small"],
                      "help": "full: a 1B model's projections; small: one [256, 512] matrix (a quick check)"}),
    ]),
    "guided": ("guided", "JSON Schema guided decoding vs free decoding of the same batch shapes", [
        ("--model", {"default": DEFAULT_MODEL}),
        ("--batch", {"type": int, "default": 32}),
        ("--new-tokens", {"type": int, "default": 96}),
        ("--rounds", {"type": int, "default": 4, "help": "rounds; the engines swap sides each round, so keep it even"}),
    ]),
    "fuzz": ("fuzz", "schemathesis over the tenant and admin APIs of a server it starts on loopback: no 5xx, "
                     "every error in the OpenAI format", [
        ("--cases", {"type": int, "default": 5000, "help": "generated requests, at least"}),
    ]),
    "soak": ("soak", "concurrent streaming clients, clean then with hostile requests mixed in, on a server it "
                     "starts on loopback: errors, TTFT, RSS drift, KV/slots back at baseline, ledger rows", [
        ("--seconds", {"type": float, "default": 60.0, "help": "per phase (clean, then hostile)"}),
        ("--clients", {"type": int, "default": 8, "help": "well-behaved streaming clients"}),
        ("--default-model", {"action": "store_true",
                             "help": "serve the default model (smollm2-135m) instead of synthetic:tiny"}),
        ("--database-url", {"default": "postgresql://postgres@localhost:5432/postgres",
                            "help": "Postgres server for a scratch database (dropped after)"}),
        ("--redis-url", {"default": "redis://localhost:6379/0",
                         "help": "Redis for the shared counters (a scratch prefix, deleted after)"}),
    ]),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark and write its JSON")
    bsub = p.add_subparsers(dest="bench", required=True)
    for name, (_, help_text, options) in BENCHMARKS.items():
        b = bsub.add_parser(name, help=help_text)
        b.add_argument("--json", dest="json_path", required=True, help="where to write the results")
        for flag, kwargs in options:
            b.add_argument(flag, **{"help": SHARED_HELP.get(flag), **kwargs})
        b.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    module_name, _, options = BENCHMARKS[args.bench]
    module = importlib.import_module(f"loraplex.cli.bench.{module_name}")
    kwargs = {flag.lstrip("-").replace("-", "_"): None for flag, _ in options}
    kwargs = {key: getattr(args, key) for key in kwargs}
    results = getattr(module, f"run_{args.bench}_bench")(**kwargs)
    out = Path(args.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(results, indent=2, sort_keys=True))
    return 0
