"""`loraplex generate`: run one prompt (or an interactive chat) through the engine in-process."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import TYPE_CHECKING

from loraplex.cli.engine_args import (
    ACTIVATION_DTYPE_HELP,
    ACTIVATION_DTYPES,
    ATTENTION_BACKEND_HELP,
    CUDA_GRAPHS_HELP,
    KV_CACHE_DTYPE_HELP,
    WEIGHT_DTYPE_HELP,
)
from loraplex.engine.api import GenerateRequest, SamplingParams

if TYPE_CHECKING:  # torch is imported only when an engine is built, not by every `loraplex` command
    from loraplex.engine.core import EngineCore


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt with a local model")
    p.add_argument("--model", default="smollm2-135m",
                   help="model name (smollm2-135m, synthetic:tiny), an HF directory or a .gguf file")
    p.add_argument("--prompt", help="the prompt; without it, an interactive chat reads lines from stdin")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    p.add_argument("--seed", type=int, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--adapter", help="a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, usage")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="hold the output to the JSON Schema in FILE (engine/guided: the keywords it enforces)")
    shape.add_argument("--json-object", action="store_true", help="hold the output to one JSON object (JSON mode)")
    p.add_argument("--device", default="auto", help="auto (default: cuda when present), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (default: bfloat16 on CUDA, float32 on the CPU), float32, "
                                                   "bfloat16 or float16")
    p.add_argument("--weight-dtype", default="auto", help=WEIGHT_DTYPE_HELP)
    p.add_argument("--activation-dtype", default="float32", choices=ACTIVATION_DTYPES, help=ACTIVATION_DTYPE_HELP)
    p.add_argument("--kv-cache-dtype", default="auto", help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--attention-backend", default="auto", help=ATTENTION_BACKEND_HELP)
    p.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"), help=CUDA_GRAPHS_HELP)
    p.set_defaults(func=run)


def _schema(args) -> str | None:
    """The --json-schema file's text (checked now, before a model loads) or JSON mode's schema."""
    if args.json_object:
        return '{"type": "object"}'
    if args.json_schema is None:
        return None
    from loraplex.engine.guided.grammar import SchemaError, check_schema

    with open(args.json_schema, encoding="utf-8") as f:
        text = f.read()
    try:
        check_schema(text)
    except SchemaError as e:
        raise ValueError(f"{args.json_schema}: {e}") from None
    return text


def _request(args, prompt: str, chat: bool) -> GenerateRequest:
    if args.max_tokens < 1:  # (the engine's 0 scores a prompt for the API's echo; here it would print nothing)
        raise ValueError(f"--max-tokens: max_tokens must be at least 1, got {args.max_tokens}")
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop), json_schema=_schema(args))
    kind = {"messages": ({"role": "user", "content": prompt},)} if chat else {"prompt": prompt}
    adapter = ADAPTER_ID if args.adapter else None
    return GenerateRequest(request_id=uuid.uuid4().hex, model=args.model, sampling=sampling, adapter=adapter, **kind)


ADAPTER_ID = "cli-adapter"


def _engine(args) -> EngineCore:
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                   weight_dtype=args.weight_dtype, activation_dtype=args.activation_dtype,
                                   kv_cache_dtype=args.kv_cache_dtype,
                                   attention_backend=args.attention_backend,
                                   cuda_graphs=args.cuda_graphs))
    if args.adapter:
        core.add_adapter(ADAPTER_ID, args.adapter)
    return core


def run(args: argparse.Namespace) -> int:
    if args.prompt is None:
        return _interactive(_engine(args), args)
    request = _request(args, args.prompt, args.chat)
    request.validate()  # a bad flag fails before the model loads
    core = _engine(args)
    if args.json:
        (done,) = core.run([request])
        u = done.usage
        print(json.dumps({
            "model": args.model, "adapter": args.adapter, "text": done.text, "token_ids": done.token_ids,
            "finish_reason": done.finish_reason,
            "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                      "total_tokens": u.total_tokens, "cached_tokens": u.cached_tokens,
                      "ttft_ms": None if u.ttft_s is None else round(u.ttft_s * 1000, 3)},
        }, ensure_ascii=False))
        return 0
    _stream(core, request)
    return 0


def _stream(core: EngineCore, request: GenerateRequest) -> None:
    """Prints text as the engine produces it."""
    core.add_request(request)
    while core.has_work():
        for event in core.step():
            sys.stdout.write(event.text)
            sys.stdout.flush()
    sys.stdout.write("\n")


def _interactive(core: EngineCore, args) -> int:
    print(f"loraplex: chatting with {args.model}; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        _stream(core, _request(args, line, chat=True))
