"""How much device memory the KV cache and the model pool get: measured on CUDA, configured elsewhere.

- On CUDA, unless the user sized the KV cache (`kv_cache_bytes`, `num_kv_blocks`), the engine profiles a maximum-size
  step once the weights are on the device and gives the KV cache what is left of `gpu_memory_utilization` x the
  device's memory:

      budget   = total * utilization - (in_use - weights) - peak_step   (weights + KV cache + adapter slots)
      kv_cache = budget - weights - adapter slots - decode graphs

  - `in_use`: what `torch.cuda.mem_get_info()` says is taken (the weights, the CUDA context, other processes);
  - `peak_step`: the activations of the largest step;
  - `decode graphs`: what static decode keeps for its CUDA graphs, captured after the KV cache exists: the largest
    bucket's activations (profiled the same way; the buckets share one graph pool, captured largest first) and its
    static logits buffer.
- The CPU keeps a configured size (`kv_cache_bytes`, default 512 MiB).
- `plan_memory` and `blocks_for_bytes` are the arithmetic of both paths, pure so that tests run them with given numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.api import MemoryStats
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv.block_pool import allocate_kv_storage, layer_views
from loraplex.engine.lora.peft import module_dims
from loraplex.engine.lora.slots import slot_buffer_bytes
from loraplex.engine.models.layer_ops import uses_cpu_kernels
from loraplex.engine.models.llama import LlamaConfig, LlamaModel
from loraplex.engine.quant import CPU_QUANTIZED

DEFAULT_KV_CACHE_BYTES = 512 * 2**20  # the KV cache where it is not measured (the CPU, a model of a pool)
MIB = 2**20


@dataclass(frozen=True)
class DeviceMemory:
    """An engine's memory sizing, in bytes (what the engine stats report).

    total, utilization, budget and peak_step are 0 where nothing was measured (the CPU, or a KV cache
    the user sized); kv_cache_bytes is the KV pool's size however it was chosen."""

    total: int = 0  # the device's memory
    utilization: float = 0.0  # gpu_memory_utilization applied to it
    weights: int = 0
    peak_step: int = 0  # activations of a maximum-size step, above the weights
    kv_cache_bytes: int = 0
    budget: int = 0  # for weights + KV cache + adapter slots, after other memory and a step's activations
    num_blocks: int = 0  # KV blocks of kv_cache_bytes

    def stats(self) -> MemoryStats:
        """The engine stats' memory record."""
        return MemoryStats(kv_cache_bytes=self.kv_cache_bytes, budget_bytes=self.budget,
                           gpu_memory_utilization=self.utilization, peak_step_bytes=self.peak_step)


def block_bytes(config: EngineConfig, model: LlamaConfig) -> int:
    """Bytes of one KV block (every layer's K and V of block_size tokens) at the KV cache's dtype (8-bit: with
    their scales)."""
    return config.block_size * model.kv_bytes_per_token(config.kv_torch_dtype)


def blocks_for_bytes(kv_bytes: int, per_block: int) -> int:
    """KV blocks that fit in `kv_bytes`, never fewer than one."""
    return max(1, kv_bytes // per_block)


def kv_blocks(config: EngineConfig, model: LlamaConfig) -> int:
    """Blocks in a model's KV pool where nothing is measured: `num_kv_blocks`, or as many as fit in
    `kv_cache_bytes` (DEFAULT_KV_CACHE_BYTES when None)."""
    kv_bytes = DEFAULT_KV_CACHE_BYTES if config.kv_cache_bytes is None else config.kv_cache_bytes
    return config.num_kv_blocks or blocks_for_bytes(kv_bytes, block_bytes(config, model))


def plan_memory(total: int, utilization: float, in_use: int, weights: int = 0, peak_step: int = 0,
                reserved: int = 0, per_block: int = 1) -> DeviceMemory:
    """The budget and KV cache `utilization` of `total` leaves, as the module docstring says, the cache
    in whole blocks of `per_block` bytes (never fewer than one).

    in_use: memory taken on the device now, the weights (`weights` of it) included; reserved: what must
    stay free beside the KV cache (adapter slot buffers not yet allocated). Raises ValueError when
    nothing is left for the KV cache."""
    usable = int(total * utilization)
    others = max(0, in_use - weights)
    budget = usable - others - peak_step
    kv = budget - weights - reserved
    if kv <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} leaves no room for the KV cache: {utilization} x "
            f"{total / MIB:.0f} MiB = {usable / MIB:.0f} MiB, of which the weights take {weights / MIB:.0f} MiB, "
            f"a step's activations {peak_step / MIB:.0f} MiB, adapter slots {reserved / MIB:.0f} MiB and other "
            f"memory in use {others / MIB:.0f} MiB; raise --gpu-memory-utilization, lower --max-num-batched-tokens "
            f"or --max-loras, or size the cache with --kv-cache-mb")
    blocks = blocks_for_bytes(kv, per_block)
    return DeviceMemory(total, utilization, weights, peak_step, blocks * per_block, budget, blocks)


def measure_device_memory(device: torch.device, utilization: float, weights: int = 0, peak_step: int = 0,
                          reserved: int = 0, per_block: int = 1) -> DeviceMemory:
    """plan_memory over what `torch.cuda.mem_get_info` reports now for a CUDA `device` (after freeing the
    caching allocator's unused blocks, which would otherwise count as taken)."""
    with torch.cuda.device(device):
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
    return plan_memory(total, utilization, total - free, weights, peak_step, reserved, per_block)


def adapter_device_bytes(cfg: EngineConfig, model: LlamaConfig, device: torch.device) -> int:
    """Device memory a model's adapters may take once it has one: the slot buffers (all `max_loras` slots
    at `max_lora_rank`, the most they grow to from the first adapter's rank); with the CPU kernels also
    the folded copies of the adapters that dominate a step (at most one per slot, about a slot's size
    each, in the model's dtype whatever the slots' lora_dtype) and, with merging on, the merged copy of the
    projections (at most all of them, packed at weight_dtype; lora/merged.py)."""
    slots = slot_buffer_bytes(model, cfg.max_loras, cfg.max_lora_rank, cfg.lora_torch_dtype)
    if not uses_cpu_kernels(device, cfg.torch_dtype):
        return slots
    folds = slot_buffer_bytes(model, cfg.max_loras, cfg.max_lora_rank, cfg.torch_dtype)
    weights = model.num_layers * sum(i * o for i, o in module_dims(model).values())
    # (the merged copy of a base quantized at load is bf16: lora/merged.py)
    projections = weights * (2 if cfg.weight_quant in CPU_QUANTIZED.values() else cfg.weight_torch_dtype.itemsize)
    return slots + folds + (projections if cfg.lora_merge_after_steps else 0)


def measures_kv_cache(config: EngineConfig) -> bool:
    """Whether the engine sizes its KV cache by measurement: on CUDA, when the user gave no size."""
    return config.torch_device.type == "cuda" and config.kv_cache_bytes is None and config.num_kv_blocks is None


@torch.inference_mode()
def dummy_step(model: LlamaModel, config: EngineConfig, max_model_len: int, tokens: int | None = None) -> int:
    """Runs a maximum-size step on dummy tokens: `tokens` (default `max_num_batched_tokens`) prompt tokens
    (in sequences of at most `max_model_len`) through the model's attention backend, with logits for every
    token (a step of prompt_logprobs requests computes that many) and their softmax. Returns the bytes of
    the temporary KV cache it wrote into."""
    n, bs, dev, cfg = tokens or config.max_num_batched_tokens, config.block_size, model.device, model.config
    lens = [min(max_model_len, n - start) for start in range(0, n, max_model_len)]
    seqs, first = [], 0
    for m in lens:
        blocks = -(-m // bs)
        seqs.append((0, m, list(range(first, first + blocks))))
        first += blocks
    storage = allocate_kv_storage(cfg.num_layers, first, bs, cfg.num_kv_heads, cfg.head_dim, config.kv_torch_dtype,
                                  dev)
    meta = model.attention.build_metadata(seqs, bs, dev, model.dtype)
    ids = torch.zeros(n, dtype=torch.long, device=dev)  # [tokens]
    positions = torch.cat([torch.arange(m, dtype=torch.long) for m in lens]).to(dev)  # [tokens]
    logits = model.forward(ids, positions, meta, layer_views(storage),
                           torch.arange(n, dtype=torch.long, device=dev))  # [tokens, vocab]
    torch.softmax(logits, dim=-1)  # what sampling allocates over the logits
    return storage.numel() * storage.element_size()


def profile_step(model: LlamaModel, config: EngineConfig, max_model_len: int, tokens: int | None = None) -> int:
    """Peak activation memory (bytes) of a maximum-size step on CUDA (dummy_step's), above what was
    allocated before it (the dummy step's own small KV cache left out)."""
    dev = model.device
    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        kv_bytes = dummy_step(model, config, max_model_len, tokens)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before - kv_bytes
    return max(0, peak)


def decode_graph_bytes(model: LlamaModel, config: EngineConfig, graph_rows: int) -> int:
    """CUDA: what static decode's graphs keep once captured (see the module docstring): the activations of a
    step of `graph_rows` one-token sequences, profiled, and the [graph_rows, vocab] fp32 logits buffer."""
    return profile_step(model, config, 1, graph_rows) + graph_rows * model.config.vocab_size * 4


def size_kv_cache(config: EngineConfig, model: LlamaModel, weight_bytes: int, max_model_len: int,
                  graph_rows: int = 0) -> DeviceMemory:
    """The engine's KV cache: measured on CUDA when the user gave no size (profiling a maximum-size step,
    with the adapter slots' computed size and, for `graph_rows` > 0 (the largest static decode bucket when
    its CUDA graphs are on), the graphs' memory kept free), else `kv_blocks`. `model` is on the device."""
    per_block = block_bytes(config, model.config)
    if not measures_kv_cache(config):
        blocks = kv_blocks(config, model.config)
        return DeviceMemory(weights=weight_bytes, kv_cache_bytes=blocks * per_block, num_blocks=blocks)
    peak = profile_step(model, config, max_model_len)
    reserved = adapter_device_bytes(config, model.config, model.device)
    if graph_rows:
        reserved += decode_graph_bytes(model, config, graph_rows)
    return measure_device_memory(model.device, config.gpu_memory_utilization, weight_bytes, peak, reserved, per_block)
