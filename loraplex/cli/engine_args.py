"""The engine options of `serve`, and the engine they build (in this process, or in each Ray Serve replica).

Every option defaults to None here, so that only those given reach the replicas' EngineConfig;
`build_engine` fills in the defaults.
"""

from __future__ import annotations

import argparse
import os

WEIGHT_DTYPE_HELP = ("the base weights under a float32 model: auto (default: a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K "
                     "blocks as stored, else the model's dtype), float32, bfloat16, int8 or int4 (quantized at load; "
                     "int4 on the CPU only), fp8 (CUDA sm89+ only)")

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_KV_CACHE_MB = 512
# (option dest, what it sets in EngineConfig); --model and --memory-budget-mb are handled apart
_CONFIG_OPTIONS = {"device": "device", "dtype": "dtype", "max_model_len": "max_model_len",
                   "speculative_tokens": "speculative_tokens", "max_loras": "max_loras",
                   "max_cpu_loras": "max_cpu_loras", "max_lora_rank": "max_lora_rank", "lora_dtype": "lora_dtype",
                   "weight_dtype": "weight_dtype", "activation_dtype": "activation_dtype",
                   "kv_cache_dtype": "kv_cache_dtype", "kv_cache_smoothing": "kv_cache_smoothing",
                   "threads": "num_threads",
                   "attention_backend": "attention_backend", "gpu_memory_utilization": "gpu_memory_utilization",
                   "cuda_graphs": "cuda_graphs", "async_scheduling": "async_scheduling"}
ENGINE_OPTIONS = ("model", "memory_budget_mb", "kv_cache_mb", *_CONFIG_OPTIONS)
CUDA_GRAPHS_HELP = ("decode steps over static bucket-padded buffers, on CUDA captured as CUDA graphs: auto (default: "
                    "on with CUDA and the triton_paged backend, off on the CPU), on (the CPU runs the static step "
                    "eagerly) or off")
ASYNC_SCHEDULING_HELP = ("schedule the next step while the device runs the current one: auto (default: on with "
                         "CUDA, off on the CPU, where nothing overlaps), on or off")
ACTIVATION_DTYPES = ("float32", "int8")  # EngineConfig's (engine.config imports torch, which `loraplex` need not)
ACTIVATION_DTYPE_HELP = ("CPU GEMMs over GGUF blocks (a GGUF's own, or --weight-dtype int8/int4): float32 "
                         "(default, exact) or int8 (activations quantized per 32 features, integer dot products: "
                         "faster at larger batches, ~0.5%% output error); refused when no projection would take it")
KV_CACHE_DTYPE_HELP = ("the KV cache's element type: auto (default: the model's dtype), float32, bfloat16, float16, "
                       "int8 or fp8; the 8-bit ones keep a scale per token and kv head, fit ~4x the blocks of fp32 "
                       "in the same memory and are dequantized as attention reads them")
KV_CACHE_SMOOTHING_HELP = ("int8 KV cache: on (default) centres and scales K per channel before rounding it, from "
                           "a calibration prefill at start (more greedy tokens kept, same bytes), or off")
ATTENTION_BACKEND_HELP = ("attention kernels: auto (default: triton_paged on CUDA, cpu_c on the CPU with the C "
                          "kernels, else torch_sdpa), torch_sdpa, cpu_c or triton_paged")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", action="append", metavar="MODEL",
                   help=f"a base model to serve; repeat it to serve several, multiplexed under --memory-budget-mb, "
                        f"the first loaded at start and the default (default {DEFAULT_MODEL})")
    g.add_argument("--memory-budget-mb", type=int,
                   help="with several models: device memory for their weights, KV caches and adapter slots together "
                        "(default: on CUDA --gpu-memory-utilization of the device less the memory in use at start, "
                        "elsewhere 80%% of the host's); idle models are evicted, least recently used first")
    g.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    g.add_argument("--dtype", help="auto (default: bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's, at most 8192)")
    g.add_argument("--kv-cache-mb", type=int,
                   help=f"KV cache size in MiB (default: on CUDA what --gpu-memory-utilization leaves after the "
                        f"weights and a maximum-size step, measured at start; elsewhere {DEFAULT_KV_CACHE_MB})")
    g.add_argument("--gpu-memory-utilization", type=float,
                   help="CUDA: the fraction of the device's memory the engine may use, for its weights, KV cache, "
                        "adapter slots and step activations (0 < f <= 1; default 0.9)")
    g.add_argument("--speculative-tokens", type=int,
                   help="n-gram speculative decoding: draft tokens per request and step, while at most 8 run "
                        "(0: off; default 4)")
    g.add_argument("--max-loras", type=int,
                   help="adapter slots on the device: distinct adapters in one step (default 8)")
    g.add_argument("--max-cpu-loras", type=int, help="parsed adapters kept in memory (default 32)")
    g.add_argument("--max-lora-rank", type=int, help="the largest adapter rank accepted (default 64)")
    g.add_argument("--lora-dtype", help="the adapter slots' dtype: auto (default: the model's), float32, bfloat16 or "
                                        "float16; 16-bit slots under a float32 model on the CPU halve what a step of "
                                        "many adapters reads, rounding each adapter's weights once")
    g.add_argument("--weight-dtype", help=WEIGHT_DTYPE_HELP)
    g.add_argument("--activation-dtype", choices=ACTIVATION_DTYPES, help=ACTIVATION_DTYPE_HELP)
    g.add_argument("--kv-cache-dtype", help=KV_CACHE_DTYPE_HELP)
    g.add_argument("--kv-cache-smoothing", choices=("on", "off"), help=KV_CACHE_SMOOTHING_HELP)
    g.add_argument("--threads", type=int, help="CPU: threads for the model's kernels (default: torch's)")
    g.add_argument("--attention-backend", help=ATTENTION_BACKEND_HELP)
    g.add_argument("--cuda-graphs", choices=("auto", "on", "off"), help=CUDA_GRAPHS_HELP)
    g.add_argument("--async-scheduling", choices=("auto", "on", "off"), help=ASYNC_SCHEDULING_HELP)


def build_engine(args: argparse.Namespace):
    """The AsyncEngine the options describe. One model: loaded now. Several: a pool that
    multiplexes them under the memory budget, the first one loaded now and the others on their first
    request. Bad options and unknown models fail here, in one line, before anything loads."""
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        # read once, when torch loads OpenMP (the imports below, in a fresh `serve` or `worker`): the engine
        # thread's C kernels follow it (torch.set_num_threads covers only the thread that calls it)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.models.loader import resolve_model
    from loraplex.engine.pool import ModelPool

    models = args.model or [DEFAULT_MODEL]
    if len(set(models)) != len(models):
        raise ValueError(f"--model names a model twice: {', '.join(models)}")
    if args.memory_budget_mb is not None and args.memory_budget_mb <= 0:
        raise ValueError(f"--memory-budget-mb must be positive, got {args.memory_budget_mb}")
    options = {field: getattr(args, dest) for dest, field in _CONFIG_OPTIONS.items() if getattr(args, dest) is not None}
    if args.kv_cache_mb is not None and args.kv_cache_mb <= 0:
        raise ValueError(f"--kv-cache-mb must be positive, got {args.kv_cache_mb}")
    kv = {} if args.kv_cache_mb is None else {"kv_cache_bytes": args.kv_cache_mb * 2**20}  # None: measured (CUDA)
    config = EngineConfig(model=models[0], **kv, **options)
    for name in models:
        resolve_model(name)
    if len(models) == 1 and args.memory_budget_mb is None:
        return AsyncEngine.from_config(config)
    budget = args.memory_budget_mb * 2**20 if args.memory_budget_mb is not None else None  # None: measured
    pool = ModelPool(memory_budget=budget, device=config.device, gpu_memory_utilization=config.gpu_memory_utilization)
    try:
        for name in models:
            pool.register_model(name, config=config)
        pool.load(models[0])
    except BaseException:
        pool.shutdown()
        raise
    return AsyncEngine(pool)
