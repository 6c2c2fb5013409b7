"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Weights are held fused (q|k|v and gate|up) so a layer runs three big GEMMs plus the output
projection. The forward pass takes a flat token batch (no padding): tokens of many requests,
prefill chunks and decodes mixed, described by `AttentionMetadata` that the runner builds once
per step and every layer shares.

Internal weight names (what loaders produce):
    embed                      [vocab, hidden]
    layers.{i}.input_norm      [hidden]
    layers.{i}.qkv             [(n_heads + 2 * n_kv_heads) * head_dim, hidden]
    layers.{i}.qkv_bias        same rows as qkv (Qwen2 only)
    layers.{i}.o               [hidden, n_heads * head_dim]
    layers.{i}.post_norm       [hidden]
    layers.{i}.gate_up         [2 * intermediate, hidden]
    layers.{i}.down            [hidden, intermediate]
    norm                       [hidden]
    lm_head                    [vocab, hidden] (absent when tie_word_embeddings, unless quantized for CUDA)
Matrices may be BlockWeights (engine/quant.py: a GGUF's own blocks, or quantized at load); norms and biases
are always float tensors.
Q and K rows are in Hugging Face order (rotate-half RoPE), not GGUF's interleaved order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from loraplex.engine.attention.base import AttentionBackend
from loraplex.engine.attention.registry import attention_backend
from loraplex.engine.kv.kv_dtype import row_width
from loraplex.engine.kv.smoothing import KvSmoothing
from loraplex.engine.models.layer_ops import embed_rows, ops_for
from loraplex.engine.quant import BlockWeight


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Llama 3.1 style frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    # the HF architecture (models/registry.py) the loaders read; synthetic models are Llama
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the model needs, by internal name, with its shape."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"embed": (self.vocab_size, h), "norm": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (self.vocab_size, h)
        qkv_rows = self.q_size + 2 * self.kv_size
        for n in range(self.num_layers):
            p = f"layers.{n}."
            shapes[p + "input_norm"] = (h,)
            shapes[p + "qkv"] = (qkv_rows, h)
            if self.attention_bias:
                shapes[p + "qkv_bias"] = (qkv_rows,)
            shapes[p + "o"] = (h, self.q_size)
            shapes[p + "post_norm"] = (h,)
            shapes[p + "gate_up"] = (2 * i, h)
            shapes[p + "down"] = (h, i)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.weight_shapes().values())

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of one token's K and V in every layer, in a KV cache of `dtype` (8-bit rows with their scales)."""
        return 2 * self.num_layers * self.num_kv_heads * row_width(self.head_dim, dtype) * dtype.itemsize


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama 3.1 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = config.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len = rs.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
        raise ValueError(f"model config: unsupported rope_scaling {rs!r}")
    return inv_freq


class LayerWeights(NamedTuple):
    """One decoder layer's weights as the ops take them (LlamaModel.layers); named, so that merged copies
    (lora/merged.py) and the fused decode step's table (kernels/cpu/decode_step.py) need no positions.
    Projections (typed object) are what `ops.prepare` made of each [out, in] weight: the tensor itself, or
    a PackedWeight on the CPU kernels."""

    input_norm: torch.Tensor  # [hidden]
    qkv: object  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None  # [q + 2 kv] (Qwen2) or None
    o: object  # [hidden, q]
    post_norm: torch.Tensor  # [hidden]
    gate_up: object  # [2 * intermediate, hidden]
    down: object  # [hidden, intermediate]


# The fused projections' LayerWeights fields (the modules adapters target and merges replace)
PROJECTIONS = ("qkv", "o", "gate_up", "down")


class LlamaModel:
    """The decoder as plain tensors; `forward` is one step over a flat token batch."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor | BlockWeight],
                 packed_dtype: torch.dtype | None = None,
                 attention: AttentionBackend | str = "auto", act8: bool = False):
        """packed_dtype: the element type the CPU kernels pack the projections and LM head in (default:
        the weights' dtype); a narrower one expects weights already rounded to it (load_model's
        weight_dtype), so that every path computes with the same values. act8: the CPU kernels' GEMMs over
        GGUF blocks (every format quant_blocks.h reads) quantize their activations to int8
        (EngineConfig.activation_dtype)."""
        expected = config.weight_shapes()
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise ValueError(f"model weights: missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(
                    f"model weights: {name} has shape {tuple(weights[name].shape)}, expected {shape}")
        self.config = config
        self.w = weights
        self.dtype = weights["norm"].dtype
        self.device = weights["norm"].device
        lm_head = weights.get("lm_head", weights["embed"])  # [vocab, hidden] (a tied model's own if quantized)
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq)  # [max_pos, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)  # [max_pos, head_dim]
        self.rope_cos = angles.cos().to(self.dtype).to(self.device)
        self.rope_sin = angles.sin().to(self.dtype).to(self.device)
        # (imported here: the registry imports this module for LlamaModel)
        from loraplex.engine.models.registry import family_for_hf

        family = family_for_hf(config.architecture, "model config")
        if isinstance(attention, str):
            attention = attention_backend(attention, self.device, self.dtype, config.head_dim)
        self.attention = attention  # every layer's attention over the paged cache (engine/attention)
        # int8 KV caches: K centred and scaled per channel, queries scaled to match (kv/smoothing.py); set by the
        # engine before the first step
        self.kv_smoothing: KvSmoothing | None = None
        self.ops = ops_for(self.rope_cos, self.rope_sin, packed_dtype, fused_decode=family.fused_cpu_decode,
                           act8=act8)
        self.lm_head_w = self.ops.prepare(lm_head)
        self.layers = [self._layer_weights(n) for n in range(config.num_layers)]
        prepared = {f"layers.{n}.{m}": getattr(layer, m) for n, layer in enumerate(self.layers) for m in PROJECTIONS}
        prepared["lm_head" if "lm_head" in weights else "embed"] = self.lm_head_w
        self.w = self.ops.resident_weights(weights, prepared)  # (blocks: their panels, on the CPU kernels)

    def _layer_weights(self, n: int) -> LayerWeights:
        p = f"layers.{n}."
        w = self.w
        prep = self.ops.prepare
        return LayerWeights(input_norm=w[p + "input_norm"], qkv=prep(w[p + "qkv"]), qkv_bias=w.get(p + "qkv_bias"),
                            o=prep(w[p + "o"]), post_norm=w[p + "post_norm"], gate_up=prep(w[p + "gate_up"]),
                            down=prep(w[p + "down"]))

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.w.values())

    def resident_bytes(self) -> int:
        """Memory the weights take: as kept (self.w) plus the packed copies not kept there already (a block
        weight's panels are its kept form: PanelBlocks)."""
        kept = {id(getattr(w, "packed", None)) for w in self.w.values()}
        packed = [self.lm_head_w] + [getattr(layer, m) for layer in self.layers for m in PROJECTIONS]
        return self.weight_bytes() + sum(p.nbytes for p in packed if not isinstance(p, torch.Tensor)
                                         and id(p) not in kept)

    def packed_bytes(self) -> int:
        """Bytes of the CPU kernels' packed projections and LM head (what an all-decode step reads of
        the weights; at the packed dtype); 0 where the ops use the weights as they are."""
        packed = [self.lm_head_w] + [getattr(layer, m) for layer in self.layers for m in PROJECTIONS]
        return sum(p.nbytes for p in packed if not isinstance(p, torch.Tensor))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
        lora=None,
        attention=None,
    ) -> torch.Tensor:
        """Runs every token once and returns logits [len(logits_indices), vocab] in fp32.

        input_ids, positions: [tokens]; kv_caches[layer] = (k, v), each
        [num_blocks, block_size, n_kv_heads, head_dim]; logits_indices: rows whose logits are needed.
        `lora` (optional) adds per-token adapter deltas: lora.apply(layer, module, x, out); an
        all-decode step may run as one fused call instead (ops.decode_step, with lora.kernel_args()).
        """
        ops = self.ops
        attention = attention or self.attention  # (the static decode path passes its own: static_decode.py)
        if attn.decode_all and ops.decode_step is not None and attention.fused_decode_step:
            logits = ops.decode_step(self, input_ids, positions, attn, kv_caches, logits_indices, lora)
            if logits is not None:
                return logits
        cfg = self.config
        eps = cfg.rms_norm_eps
        qk_size = cfg.q_size + cfg.kv_size
        rope = ops.rope_state(positions)
        h = embed_rows(self.w["embed"], input_ids, self.dtype)  # h: [tokens, hidden], the residual stream
        n_tok = h.shape[0]
        delta = None  # the previous sublayer's output, added to h by the next add_rms_norm
        for li, lw in enumerate(self.layers):  # lw: LayerWeights, every projection [out, in]
            h, x = ops.add_rms_norm(h, delta, lw.input_norm, eps)
            qkv = ops.linear(x, lw.qkv, lw.qkv_bias)  # [tokens, q + 2 kv]
            if lora is not None:
                lora.apply(li, "qkv", x, qkv)
            q, k = ops.rope_qk(qkv, rope, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            if self.kv_smoothing is not None:
                self.kv_smoothing.apply(li, q, k)
            v = qkv[:, qk_size:].view(n_tok, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = kv_caches[li]
            attn_out = attention.forward(q, k, v, k_cache, v_cache, attn)  # [tokens, q_size]
            o = ops.linear(attn_out, lw.o)
            if lora is not None:
                lora.apply(li, "o", attn_out, o)
            h, x = ops.add_rms_norm(h, o, lw.post_norm, eps)
            gate_up = ops.linear(x, lw.gate_up)  # [tokens, 2 * intermediate]
            if lora is not None:
                lora.apply(li, "gate_up", x, gate_up)
            act = ops.silu_mul(gate_up)  # [tokens, intermediate]
            delta = ops.linear(act, lw.down)
            if lora is not None:
                lora.apply(li, "down", act, delta)
        h_out, delta_out = (torch.index_select(t, 0, logits_indices) for t in (h, delta))  # [sampled, hidden]
        _, x = ops.add_rms_norm(h_out, delta_out, self.w["norm"], eps)
        return ops.linear(x, self.lm_head_w).float()  # [len(logits_indices), vocab]
