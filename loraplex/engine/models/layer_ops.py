"""The decoder's per-layer operations, in two implementations chosen once per model.

- `TorchOps` runs anywhere (CUDA, CPU, any dtype). Block-quantized weights (engine/quant.py) are dequantized
  once, at load; int8 / FP8 weights (kernels/quant_linear.py) run through their own GEMMs.
- `CpuKernelOps` replaces the projections (over weights packed once: in fp32, in bf16 with
  EngineConfig.weight_dtype bfloat16, or in their GGUF blocks), the residual add + RMSNorm and RoPE with
  the C kernels of kernels/cpu when the model runs on the CPU in fp32 and the kernels are built (attention
  is the attention backend's: engine/attention); results agree with TorchOps to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.engine.kernels import quant_linear
from loraplex.engine.kernels.quant_linear import QuantizedLinearWeight
from loraplex.engine.quant import BlockWeight, dequantize


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [tokens, hidden]; statistics in fp32 whatever the model dtype.
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op on the fp32 path
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [tokens, heads, head_dim]; cos, sin: [tokens, 1, head_dim] with each
    half-frequency repeated twice, so x * cos + rotate_half(x) * sin is the rotation."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)


def embed_rows(embed: torch.Tensor | BlockWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The embedding rows of `ids` [tokens] -> [tokens, hidden] in `dtype` (a block table dequantizes only them)."""
    if isinstance(embed, BlockWeight):
        return embed.rows(ids).to(dtype)
    return torch.index_select(embed, 0, ids)


class TorchOps:
    decode_step = None  # no fused step: the model runs layer by layer

    def __init__(self, rope_cos: torch.Tensor, rope_sin: torch.Tensor):
        self.rope_cos, self.rope_sin = rope_cos, rope_sin  # [max_pos, head_dim]

    def rope_state(self, positions: torch.Tensor):
        """Once per forward, what rope_qk needs for these positions [tokens]: here the per-token
        cos and sin rows [tokens, 1, head_dim]."""
        cos = torch.index_select(self.rope_cos, 0, positions).unsqueeze(1)
        return cos, torch.index_select(self.rope_sin, 0, positions).unsqueeze(1)

    def resident_weights(self, weights: dict, prepared: dict) -> dict:
        """The weights the model keeps once `prepared` (name -> what prepare made of it) exists: here all."""
        return weights

    def prepare(self, w: torch.Tensor | BlockWeight):
        """A projection weight [out, in] as `linear` takes it (done once, at model load)."""
        if isinstance(w, BlockWeight):
            return dequantize(w).to(self.rope_cos.dtype)
        return w

    def linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, QuantizedLinearWeight):  # int8 (W8A16) or FP8 (torch._scaled_mm)
            return quant_linear.linear(x, w, bias)
        return F.linear(x, w, bias)  # x: [tokens, in]; w: [out, in] -> [tokens, out]

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta) * w): the residual stream and the next sublayer's input."""
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, w, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, gate_up: [tokens, 2 * intermediate] -> [tokens, intermediate]."""
        inter = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def rope_qk(self, qkv: torch.Tensor, rope, n_heads: int, n_kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] rotated, from the fused qkv
        rows [tokens, q + 2 kv]; `rope` is rope_state(positions)."""
        n_qk = n_heads + n_kv_heads
        qk = apply_rope(qkv[:, :n_qk * head_dim].view(qkv.shape[0], n_qk, head_dim), *rope)
        return qk[:, :n_heads], qk[:, n_heads:]


class CpuKernelOps(TorchOps):
    def __init__(self, rope_cos: torch.Tensor, rope_sin: torch.Tensor, packed_dtype: torch.dtype = torch.float32,
                 fused_decode: bool = True, act8: bool = False):
        """fused_decode: whether all-decode steps take the fused C step (the model family's
        fused_cpu_decode, models/registry.py); when False they run op by op like any other step. act8: GEMMs
        over GGUF blocks quantize their activations to int8 (kernels/cpu/linear_act8.h), in every step (the
        fused one too: its model table carries each weight's kind)."""
        super().__init__(rope_cos, rope_sin)
        from loraplex.engine.kernels.cpu import decode_step, layer_ops, linear

        self.k, self.lin, self.step = layer_ops, linear, decode_step
        self.packed_dtype = packed_dtype  # the packed projections' element type (float32 or bfloat16)
        self.fused_decode = fused_decode
        self.act8 = act8
        # (id(kv_caches), id(layers)) -> (kv_caches, layers, DecodeStepModel); layers are the model's, or
        # a merged adapter's copy of them (lora/merged.py)
        self._step_models: dict[tuple[int, int], tuple] = {}

    def rope_state(self, positions):
        # checked here once per forward; the C kernel indexes the tables with them
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= self.rope_cos.shape[0]):
            raise ValueError(f"positions must lie in [0, {self.rope_cos.shape[0]})")
        return positions.contiguous()

    def prepare(self, w):
        if isinstance(w, self.lin.PanelBlocks):  # (a model built again over weights another one packed)
            return self.lin.with_act8(w.packed, self.act8)
        if isinstance(w, BlockWeight):  # its blocks, as they are (linear.c's quantized builds)
            return self.lin.with_act8(self.lin.pack_blocks(w), self.act8)
        return self.lin.pack(w, dtype=self.packed_dtype)  # linear.c's panel layout

    def resident_weights(self, weights, prepared):
        """Blocks give way to their panels (PanelBlocks): a resident model holds its blocks once."""
        return {name: self.lin.PanelBlocks(prepared[name]) if isinstance(w, BlockWeight) and name in prepared
                else w for name, w in weights.items()}

    def linear(self, x, w, bias=None):
        return self.lin.packed_linear(x, w, bias)

    def add_rms_norm(self, h, delta, w, eps):
        if h.is_contiguous() and (delta is None or delta.is_contiguous()):
            return h, self.k.add_rms_norm(h, delta, w, eps)  # h updated in place
        return super().add_rms_norm(h, delta, w, eps)

    def silu_mul(self, gate_up):
        return self.k.silu_mul(gate_up)

    def decode_step(self, model, input_ids, positions, attn, kv_caches, logits_indices, lora):
        """Every layer of an all-decode step in one C call (kernels/cpu/decode_step.c), the same
        kernels in the same order as the per-op path; None when this step takes the per-op path
        (the model's family is not served by the fused step, more rows than the packed kernel serves,
        or adapters without a kernel table)."""
        if not self.fused_decode or input_ids.shape[0] > self.lin.packed_max_rows():
            return None
        lora_args, layers = (None, None, None), model.layers
        if lora is not None:
            kernel_args = lora.kernel_args()
            if kernel_args is None:
                return None
            *lora_args, merged = kernel_args
            if merged is not None:  # every token on one merged adapter: its weights, no LoRA work
                layers = merged
        smoothing = model.kv_smoothing
        key = (id(kv_caches), id(layers), id(smoothing))
        entry = self._step_models.get(key)
        if entry is None or entry[0] is not kv_caches or entry[1] is not layers or entry[2] is not smoothing:
            if len(self._step_models) >= 4:  # runners come and go with model residency, merged copies with adapters
                self._step_models.clear()
            entry = (kv_caches, layers, smoothing, self._step_model(model, kv_caches, layers))
            self._step_models[key] = entry
        h = embed_rows(model.w["embed"], input_ids, model.dtype)  # [tokens, hidden]
        return entry[3].run(h, positions, attn.slot_mapping, attn.decode_blocks, attn.decode_lens, logits_indices,
                            *lora_args)

    def _step_model(self, model, kv_caches, weights):
        """The model table of `weights` (LayerWeights per layer: the model's or a merged copy) over
        kv_caches [(k, v) per layer], with the model's K smoothing if it has one."""
        cfg, sm = model.config, model.kv_smoothing
        layers = [self.step.StepLayer(w, k, v, None if sm is None else sm.layer_table(i))
                  for i, (w, (k, v)) in enumerate(zip(weights, kv_caches, strict=True))]
        return self.step.DecodeStepModel(
            hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps, rope_cos=self.rope_cos, rope_sin=self.rope_sin,
            norm=model.w["norm"], lm_head=model.lm_head_w, layers=layers)

    def rope_qk(self, qkv, rope, n_heads, n_kv_heads, head_dim):
        self.k.rope_(qkv, n_heads + n_kv_heads, head_dim, rope, self.rope_cos, self.rope_sin)  # in place
        t = qkv.shape[0]
        q = qkv[:, :n_heads * head_dim].view(t, n_heads, head_dim)
        k = qkv[:, n_heads * head_dim:(n_heads + n_kv_heads) * head_dim].view(t, n_kv_heads, head_dim)
        return q, k


def uses_cpu_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.float32:
        return False
    from loraplex.engine.kernels.cpu.decode_step import decode_step_available
    from loraplex.engine.kernels.cpu.layer_ops import layer_ops_available
    from loraplex.engine.kernels.cpu.linear import linear_available

    return linear_available() and layer_ops_available() and decode_step_available()


def weight_copies(device: torch.device, dtype: torch.dtype, packed_dtype: torch.dtype | None = None) -> float:
    """Copies of the weights a resident model holds, in units of the weights at `dtype`: with the CPU
    kernels the loaded weights (which prefill-sized GEMMs, the embedding and reloads use) and the
    packed projections at `packed_dtype` (default: dtype), so 2, or 1.5 with bf16 panels; else 1."""
    if not uses_cpu_kernels(device, dtype):
        return 1
    return 1 + (packed_dtype or dtype).itemsize / dtype.itemsize


def resident_weight_bytes(weights: dict, device: torch.device, dtype: torch.dtype,
                          packed_dtype: torch.dtype | None = None) -> int:
    """Memory a resident model's weights take: float tensors times weight_copies; blocks once with the CPU
    kernels (their panels are their only copy: CpuKernelOps.resident_weights), else as loaded plus their
    dequantized copies; CUDA's int8 / FP8 weights as they are."""
    floats = sum(w.nbytes for w in weights.values() if isinstance(w, torch.Tensor))
    blocks = [w for w in weights.values() if isinstance(w, BlockWeight)]
    quantized = sum(w.nbytes for w in weights.values() if isinstance(w, QuantizedLinearWeight))
    extra = 0 if uses_cpu_kernels(device, dtype) else sum(w.shape.numel() * dtype.itemsize for w in blocks)
    return int(floats * weight_copies(device, dtype, packed_dtype)) + sum(w.nbytes for w in blocks) + extra + quantized


def ops_for(rope_cos: torch.Tensor, rope_sin: torch.Tensor, packed_dtype: torch.dtype | None = None,
            fused_decode: bool = True, act8: bool = False) -> TorchOps:
    """The model's operations; packed_dtype (CPU kernels only; default: the model's dtype) is the
    element type its projections are packed in; fused_decode (CPU kernels only) whether all-decode
    steps may take the fused C step (the family's fused_cpu_decode)."""
    if uses_cpu_kernels(rope_cos.device, rope_cos.dtype):
        return CpuKernelOps(rope_cos, rope_sin, packed_dtype or rope_cos.dtype, fused_decode, act8)
    return TorchOps(rope_cos, rope_sin)
