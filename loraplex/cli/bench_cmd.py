"""`loraplex bench <name> --json PATH`: benchmarks that compare side by side in one run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark and write its JSON")
    bsub = p.add_subparsers(dest="bench", required=True)
    e = bsub.add_parser("engine", help="engine tokens/s vs HF transformers, with the machine's roofline")
    e.add_argument("--json", dest="json_path", required=True, help="where to write the results")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--new-tokens", type=int, default=64)
    e.add_argument("--batch1-prompts", type=int, default=3, help="prompts run one at a time at batch 1")
    e.add_argument("--batch", type=int, default=32)
    e.add_argument("--skip-hf", action="store_true", help="measure our engine only")
    e.set_defaults(func=_run_engine)
    lo = bsub.add_parser("lora", help="multi-LoRA tokens/s (identical, zipf, distinct) vs base and HF PEFT")
    lo.add_argument("--json", dest="json_path", required=True)
    lo.add_argument("--model", default="smollm2-135m")
    lo.add_argument("--batch", type=int, default=32)
    lo.add_argument("--rank", type=int, default=16)
    lo.add_argument("--new-tokens", type=int, default=64)
    lo.add_argument("--peft-new-tokens", type=int, default=16,
                    help="PEFT's mixed-adapter batch is slow: fewer tokens keep the run short (tok/s is reported)")
    lo.add_argument("--skip-peft", action="store_true")
    lo.set_defaults(func=_run_lora)
    gw = bsub.add_parser("gateway", help="latency the platform adds (auth, limits, routing, usage) and its max rps")
    gw.add_argument("--json", dest="json_path", required=True)
    gw.add_argument("--database-url", default="postgresql://postgres@localhost:5432/postgres",
                    help="Postgres server for a scratch database (dropped after); 'sqlite' for embedded")
    gw.add_argument("--redis-url", default="redis://localhost:6379/0", help="'none' for in-process counters")
    gw.add_argument("--rate", type=float, default=200.0, help="open-loop requests/s for the latency figures")
    gw.add_argument("--seconds", type=float, default=10.0)
    gw.add_argument("--concurrency", type=int, default=32, help="connections for the max_rps run")
    gw.add_argument("--tokens", type=int, default=16, help="tokens the fake engine returns per request")
    gw.set_defaults(func=_run_gateway)
    px = bsub.add_parser("prefix", help="TTFT with a shared system prompt, prefix cache on vs off")
    px.add_argument("--json", dest="json_path", required=True)
    px.add_argument("--model", default="smollm2-135m")
    px.add_argument("--requests", type=int, default=32)
    px.add_argument("--system-tokens", type=int, default=500)
    px.add_argument("--question-tokens", type=int, default=50)
    px.set_defaults(func=_run_prefix)
    pr = bsub.add_parser("priority", help="realtime TTFT under batch load, priority classes vs FCFS")
    pr.add_argument("--json", dest="json_path", required=True)
    pr.add_argument("--model", default="smollm2-135m")
    pr.add_argument("--max-num-seqs", type=int, default=8)
    pr.add_argument("--batch-tokens", type=int, default=96)
    pr.add_argument("--realtime-requests", type=int, default=8)
    pr.add_argument("--interval", type=float, default=0.5, help="seconds between realtime requests")
    pr.set_defaults(func=_run_priority)
    mx = bsub.add_parser("multiplex", help="model load times per tier, alternating two models vs one")
    mx.add_argument("--json", dest="json_path", required=True)
    mx.add_argument("--requests", type=int, default=8)
    mx.add_argument("--new-tokens", type=int, default=32)
    mx.set_defaults(func=_run_multiplex)


def _write(path: str, results: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(results, indent=2, sort_keys=True))


def _run_engine(args: argparse.Namespace) -> int:
    from loraplex.cli.bench.engine import run_engine_bench

    _write(args.json_path, run_engine_bench(
        model=args.model, new_tokens=args.new_tokens, batch1_prompts=args.batch1_prompts,
        batch=args.batch, with_hf=not args.skip_hf))
    return 0


def _run_lora(args: argparse.Namespace) -> int:
    from loraplex.cli.bench.lora import run_lora_bench

    _write(args.json_path, run_lora_bench(
        model=args.model, batch=args.batch, rank=args.rank, new_tokens=args.new_tokens,
        peft_new_tokens=args.peft_new_tokens, with_peft=not args.skip_peft))
    return 0


def _run_prefix(args: argparse.Namespace) -> int:
    from loraplex.cli.bench.scheduling import run_prefix_bench

    _write(args.json_path, run_prefix_bench(args.model, args.requests, args.system_tokens, args.question_tokens))
    return 0


def _run_priority(args: argparse.Namespace) -> int:
    from loraplex.cli.bench.scheduling import run_priority_bench

    _write(args.json_path, run_priority_bench(args.model, args.max_num_seqs, args.batch_tokens,
                                              args.realtime_requests, args.interval))
    return 0


def _run_gateway(args: argparse.Namespace) -> int:
    from loraplex.cli.bench.gateway import run_gateway_bench

    _write(args.json_path, run_gateway_bench(
        database_url=None if args.database_url == "sqlite" else args.database_url,
        redis_url=None if args.redis_url == "none" else args.redis_url, rate=args.rate, seconds=args.seconds,
        concurrency=args.concurrency, tokens=args.tokens))
    return 0


def _run_multiplex(args: argparse.Namespace) -> int:
    from loraplex.cli.bench.multiplex import run_multiplex_bench

    _write(args.json_path, run_multiplex_bench(args.requests, args.new_tokens))
    return 0
