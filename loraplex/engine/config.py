"""Engine configuration: frozen dataclasses, validated once when they are made."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.engine.quant import CPU_QUANTIZED, CUDA_QUANTIZED

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV cache's element types by name (kv_cache_dtype; "auto": the model's dtype). The 8-bit ones carry a
# scale per (token, kv head) in each cache row (engine/kv/kv_dtype.py).
KV_CACHE_DTYPES = {**_DTYPES, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4", "fp8")
ACTIVATION_DTYPES = ("float32", "int8")
# engine/attention's backends; "auto": triton_paged on CUDA, cpu_c on the CPU with the C kernels, else torch_sdpa
ATTENTION_BACKENDS = ("auto", "torch_sdpa", "cpu_c", "triton_paged")


def default_cache_dir() -> Path:
    """Where derived files live (dequantized weights, built CPU kernels): $LORAPLEX_CACHE_DIR or
    ~/.cache/loraplex."""
    return Path(os.environ.get("LORAPLEX_CACHE_DIR") or Path.home() / ".cache" / "loraplex")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class EngineConfig:
    """One base model's engine: its KV pool and scheduler limits.

    dtype "auto" is bfloat16 on CUDA and float32 on CPU. The KV pool holds `num_kv_blocks`
    blocks, or as many as fit in `kv_cache_bytes` when that is None; when both are None, on CUDA what
    `gpu_memory_utilization` of the device leaves after the weights and a maximum-size step's
    activations (measured: engine/memory.py), elsewhere 512 MiB.
    """

    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length, capped at 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # tokens one step may compute (chunked prefill budget)
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # fraction of the device's memory the engine may use (CUDA)
    num_threads: int | None = None  # CPU: torch threads (None = torch's default)
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS (engine/attention)
    # All-decode steps over static, bucket-padded buffers (engine/static_decode.py): on CUDA "auto" and "on"
    # capture one CUDA graph per bucket when the attention backend is triton_paged; on the CPU "on" runs the
    # same static step eagerly (no graphs there) and "auto" is off. "off": every step dynamic.
    cuda_graphs: str = "auto"
    # Schedule step N+1 while step N runs on the device, feeding N's tokens to N+1 there (core.py): "auto" is on
    # with CUDA and off on the CPU, where the device is the host and nothing overlaps; "on" runs it anywhere.
    async_scheduling: str = "auto"
    # LoRA: device slots (distinct adapters in one step), largest rank, parsed adapters kept in memory.
    # The slot buffers are allocated when the first adapter is registered.
    # Scheduling: admission weights of realtime:standard:batch, the wait after which any request goes
    # first, what preemption does with a victim's KV ("recompute" or "swap" to a CPU space of
    # swap_space_bytes), and prefix caching.
    priority_weights: tuple[float, float, float] = (10.0, 5.0, 1.0)
    priority_aging_s: float = 30.0
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 256 * 1024 * 1024
    enable_prefix_caching: bool = True
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    # The slot buffers' element type: "auto" is the model's dtype. bfloat16 or float16 under an fp32 model
    # halves the slots' memory and what a step of many adapters reads (on the CPU: kernels/cpu/lora_weights.h;
    # the Triton kernels upcast both operands); each adapter's weights are rounded to it once, as they are
    # written into a slot.
    lora_dtype: str = "auto"
    # The base weights' element type under an fp32 model. "auto": a GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K
    # tensors keep their blocks (engine/quant.py; the CPU kernels dequantize them in registers,
    # kernels/cpu/quant_blocks.h; other devices dequantize them once at load), everything else the model's dtype.
    # "float32" dequantizes every tensor. "bfloat16" rounds every weight once at load (as if a bf16 checkpoint had
    # been loaded) and, with the CPU kernels, packs the projections and LM head in bf16 (kernels/cpu/linear_bf16.c).
    # "int8" / "int4" quantize the projections at load to Q8_0 / Q4_1 blocks (per 32 weights, round to nearest) and
    # the LM head to Q8_0. Activations and sums stay fp32 in every case. On CUDA, "int8" quantizes the projections
    # and LM head per output channel for the W8A16 Triton kernel and "fp8" to e4m3 with per-channel scales for
    # torch._scaled_mm (sm89+) (kernels/quant_linear.py); int4 is the CPU's only.
    weight_dtype: str = "auto"
    # The CPU kernels' activations in GEMMs over GGUF blocks (a GGUF's own Q8_0 ... Q6_K, or weight_dtype int8 /
    # int4): "float32" (exact: the fp32 GEMM over the blocks' values) or "int8": each row quantized per 32 features
    # (absmax / 127, round to nearest) and multiplied as integers (kernels/cpu/linear_act8.h, vpdpbusd with
    # VNNI), in prefill and in the fused decode step alike. Other weights (fp32 / bf16 panels, a merged adapter's
    # copy) keep fp32 activations; the engine refuses int8 when no projection would take it.
    activation_dtype: str = "float32"
    # The KV cache's element type: "auto" is the model's dtype; float32, bfloat16 or float16 store K/V rounded
    # to it; int8 and fp8 (e4m3) store each token's K/V per kv head as 8-bit values and an fp32 scale
    # (absmax / 127, absmax / 448), about a quarter of an fp32 cache: more blocks in the same memory and a
    # quarter of what a decode step reads of it. Attention dequantizes as it reads, in fp32.
    kv_cache_dtype: str = "auto"
    # 8-bit KV caches: "on" centres and scales K per channel before quantizing it, from statistics of a
    # calibration prefill at start (kv/smoothing.py); "off": rows as they come
    kv_cache_smoothing: str = "on"
    # CPU fused decode steps: once one adapter has held every token of this many decode steps in a row,
    # it is merged into a copy of the projection weights and such steps run without LoRA work
    # (lora/merged.py; one copy, about the size of the projections). 0: never.
    lora_merge_after_steps: int = 16
    # Speculative decoding by n-gram lookup (sched/ngram.py): up to this many draft tokens per request
    # (greedy, or sampled without a seed) and step, verified in that step; only while at most
    # speculative_max_seqs requests run (each draft is one more row in every GEMM; at 16 requests the
    # drafts saved nothing measurable: bench/RESULTS.md, "Speculative decoding"). 0: off.
    speculative_tokens: int = 4
    speculative_max_seqs: int = 8
    # Guided decoding (engine/guided), bounds per request: a schema longer than guided_schema_max_bytes, or
    # not compiled within guided_compile_timeout_s, is refused (400) before it is queued; a mask not ready
    # guided_mask_timeout_s after its step started ends that request alone (finish_reason "error").
    # llguidance's own limits: grammar symbols, lexer fuel to build the grammar and per step, parser items
    # per step, lexer states (1-2 KB each).
    guided_schema_max_bytes: int = 64 * 1024
    guided_compile_timeout_s: float = 2.0
    guided_mask_timeout_s: float = 0.1
    guided_max_grammar_size: int = 200_000
    guided_lexer_fuel: int = 1_000_000
    guided_step_lexer_fuel: int = 200_000
    guided_step_max_items: int = 50_000
    guided_max_lexer_states: int = 50_000

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"engine config: device must be auto, cpu or cuda[:n], got {self.device!r}")
        for name in ("dtype", "lora_dtype"):
            if getattr(self, name) != "auto" and getattr(self, name) not in _DTYPES:
                raise ValueError(f"engine config: {name} must be auto or one of {sorted(_DTYPES)}, "
                                 f"got {getattr(self, name)!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"engine config: kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_smoothing not in ("on", "off"):
            raise ValueError(f"engine config: kv_cache_smoothing must be on or off, got {self.kv_cache_smoothing!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"engine config: attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        for name in ("cuda_graphs", "async_scheduling"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise ValueError(f"engine config: {name} must be auto, on or off, got {getattr(self, name)!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"engine config: weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, "
                             f"got {self.weight_dtype!r}")
        cuda = self.torch_device.type == "cuda"
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"engine config: activation_dtype must be one of {', '.join(ACTIVATION_DTYPES)}, "
                             f"got {self.activation_dtype!r}")
        if self.activation_dtype == "int8" and (cuda or self.weight_dtype not in ("auto", "int8", "int4")):
            raise ValueError(f"engine config: activation_dtype int8 runs on the CPU over GGUF blocks (weight_dtype "
                             f"auto, int8 or int4), not with device {self.device} and weight_dtype {self.weight_dtype}")
        if self.weight_dtype in ("int4", "fp8") and cuda != (self.weight_dtype == "fp8"):
            raise ValueError(f"engine config: weight_dtype {self.weight_dtype} runs on "
                             f"{'CUDA' if self.weight_dtype == 'fp8' else 'the CPU'} only (device {self.device})")
        if self.weight_dtype in _DTYPES and self.torch_dtype not in (torch.float32, _DTYPES[self.weight_dtype]):
            raise ValueError(f"engine config: weight_dtype {self.weight_dtype} needs a float32 model, the model's "
                             f"dtype is {self.dtype}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras",
                     "max_lora_rank", "max_cpu_loras", "guided_schema_max_bytes", "guided_max_grammar_size",
                     "guided_lexer_fuel", "guided_step_lexer_fuel", "guided_step_max_items", "guided_max_lexer_states"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine config: {name} must be >= 1, got {getattr(self, name)}")
        if self.speculative_tokens < 0 or self.speculative_max_seqs < 1:
            raise ValueError(f"engine config: speculative_tokens must be >= 0 and speculative_max_seqs >= 1, got "
                             f"{self.speculative_tokens} and {self.speculative_max_seqs}")
        for name in ("guided_compile_timeout_s", "guided_mask_timeout_s"):
            if not 0 < getattr(self, name) <= 60:
                raise ValueError(f"engine config: {name} must be in (0, 60] seconds, got {getattr(self, name)}")
        if self.lora_merge_after_steps < 0:
            raise ValueError(f"engine config: lora_merge_after_steps must be >= 0, got {self.lora_merge_after_steps}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"engine config: preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if len(self.priority_weights) != 3 or any(w <= 0 for w in self.priority_weights):
            raise ValueError(f"engine config: priority_weights must be 3 positive numbers, got {self.priority_weights}")
        if self.priority_aging_s <= 0:
            raise ValueError(f"engine config: priority_aging_s must be > 0, got {self.priority_aging_s}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"engine config: max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"engine config: num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"engine config: kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:  # (false for nan too)
            raise ValueError(f"engine config: gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")

    @property
    def async_scheduling_on(self) -> bool:
        return self.async_scheduling == "on" or (self.async_scheduling == "auto" and self.torch_device.type == "cuda")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(default_device() if self.device == "auto" else self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def weight_torch_dtype(self) -> torch.dtype:
        """The base weights' element type (weight_dtype; "auto": the model's)."""
        return _DTYPES.get(self.weight_dtype, self.torch_dtype)

    @property
    def weight_quant(self) -> str | None:
        """What load_model does with quantized weights (its `quant`): "keep" (a GGUF's own blocks), what to
        quantize float weights to (a block format on the CPU, a quant_linear kind on CUDA), or None (every
        weight a float tensor)."""
        if self.weight_dtype == "auto":
            return "keep"
        table = CUDA_QUANTIZED if self.torch_device.type == "cuda" else CPU_QUANTIZED
        return table.get(self.weight_dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type (kv_cache_dtype; "auto": the model's)."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def lora_torch_dtype(self) -> torch.dtype:
        """The adapter slots' dtype (lora_dtype; "auto": the model's)."""
        return self.torch_dtype if self.lora_dtype == "auto" else _DTYPES[self.lora_dtype]
