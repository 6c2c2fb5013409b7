"""Static K smoothing for int8 KV caches: each K channel centred and scaled, per layer, before its row is quantized.

- Why: in Llama-family models a few K channels carry large offsets and magnitudes. One scale per (token, kv head)
  (kv/kv_dtype.py) is set by them, and the other channels round to a few levels of the int8 grid: with the
  default model, int8 rows kept 0.64 of greedy tokens; centred and scaled, 0.82 (bench/RESULTS.md).
- What: per layer, kv head and channel, the mean m and the RMS about it s of K (after RoPE) over CALIBRATION, one
  prefill at engine start. The cache holds rows of k' = (k - m) / s and queries become q' = q * s (the s of the
  query head's kv head), so q'.k' = q.k - q.m: q.m is the same for every key a query reads, and softmax ignores
  it. Attention kernels are unchanged, and so is the cache layout.
- Traffic cannot move it: m and s are fixed before the first request, from the model alone, so a token's row
  depends only on its own K (chunking, preemption, prefix-cache hits and replicas agree).
- Where it applies: LlamaModel.forward after RoPE (`apply`) and the fused CPU decode step (`layer_table`, the
  same operations in the same order: decode_step.c's smooth_qk), for int8 caches only: fp8's error is its
  3-bit mantissa's, relative to each value, and smoothing did not move its agreement (bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Calibration texts, written for this purpose: mixed registers (code, arithmetic, translation, lists, chat,
# explanation), none of them like the bench prompts. The model's chat template wraps each as a user turn.
CALIBRATION = (
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))"
    "\n    return out + a + b\n\nExplain what this function does and fix its complexity.",
    "A train leaves at 3:15 pm and travels 240 km at 80 km/h. It stops for 20 minutes. When does it arrive? "
    "Show each step, then give the answer as HH:MM.",
    "Translate into French: The meeting moved to Thursday because half the team is travelling, and the "
    "budget review needs everyone in the room.",
    "List five uses of vinegar around the house, one line each, no more than ten words per line.",
    "Hi! I just adopted a kitten and she keeps biting my hands when we play. Is that normal? What should I do?",
    "Summarize the causes of the French Revolution in three bullet points for a high-school student.",
)
# A channel whose RMS is below this fraction of its head's mean RMS is scaled as if it were this large: a channel
# that barely moved in calibration must not be blown up by the traffic's K
MIN_RELATIVE_SCALE = 1e-2


@dataclass(frozen=True)
class KvSmoothing:
    """Per layer: the query scale [layers, heads, head_dim] (s of each query head's kv head), K's mean and its
    inverse scale [layers, kv_heads, head_dim]; fp32, on the model's device."""

    q_scale: torch.Tensor
    k_mean: torch.Tensor
    k_inv_scale: torch.Tensor

    def apply(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """q [tokens, heads, head_dim] *= s and k [tokens, kv_heads, head_dim] = (k - m) / s, in place (views of
        the step's qkv rows stay views); k's subtraction, then its multiplication by 1/s, as smooth_qk does."""
        q.mul_(self.q_scale[layer])
        k.sub_(self.k_mean[layer]).mul_(self.k_inv_scale[layer])

    def layer_table(self, layer: int) -> torch.Tensor:
        """[heads * head_dim + 2 * kv_heads * head_dim] fp32 on the CPU: q's scale, K's mean, K's inverse scale,
        each flattened (head-major): decode_step.c's L_KV_SMOOTH."""
        return torch.cat([t[layer].reshape(-1) for t in (self.q_scale, self.k_mean, self.k_inv_scale)]).cpu()


def calibration_prompts(tokenizer) -> list[list[int]]:
    """CALIBRATION as token ids: each a user turn under the model's chat template, or raw text without one."""
    out = []
    for text in CALIBRATION:
        if tokenizer.chat_template:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            out.append(tokenizer.encode(rendered, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(text))
    return out


class _KRecorder:
    """An attention backend that records each layer's K rows [tokens, kv_heads, head_dim] and lets `inner` attend."""

    fused_decode_step = False

    def __init__(self, inner):
        self.inner = inner
        self.k_rows: list[torch.Tensor] = []

    def build_metadata(self, *args):
        return self.inner.build_metadata(*args)

    def forward(self, q, k, v, k_cache, v_cache, meta):
        self.k_rows.append(k.to(torch.float64, copy=True))  # (copied: the backend may write k in place)
        return self.inner.forward(q, k, v, k_cache, v_cache, meta)


def calibrate(model, prompts: list[list[int]], block_size: int = 16) -> KvSmoothing:
    """Each layer's K statistics over `prompts` (one prefill step, every prompt its own sequence, into a
    temporary cache of the model's dtype) -> the model's KvSmoothing. `model`: a LlamaModel."""
    cfg, device, dtype = model.config, model.device, model.dtype
    seqs, ids, positions, used = [], [], [], 0
    for p in prompts:
        n_blocks = -(-len(p) // block_size)
        seqs.append((0, len(p), list(range(used, used + n_blocks))))
        used += n_blocks
        ids += p
        positions += range(len(p))
    caches = [tuple(torch.zeros(used, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
                    for _ in range(2)) for _ in range(cfg.num_layers)]
    recorder = _KRecorder(model.attention)
    meta = recorder.build_metadata(seqs, block_size, device, dtype)
    with torch.inference_mode():
        model.forward(torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta, caches,
                      torch.tensor([len(ids) - 1], device=device), attention=recorder)
    return from_k_rows(torch.stack(recorder.k_rows), cfg.num_heads // cfg.num_kv_heads)


def from_k_rows(k: torch.Tensor, group: int) -> KvSmoothing:
    """The smoothing of K rows k [layers, tokens, kv_heads, head_dim] (group: query heads per kv head), on k's
    device: each channel's mean, and its RMS about the mean (floored at MIN_RELATIVE_SCALE of its head's)."""
    k = k.double()
    mean = k.mean(1)
    rms = (k - mean.unsqueeze(1)).pow(2).mean(1).sqrt()  # [layers, kv_heads, head_dim]
    scale = torch.maximum(rms, MIN_RELATIVE_SCALE * rms.mean(-1, keepdim=True)).clamp_min(1e-12)
    return KvSmoothing(q_scale=scale.repeat_interleave(group, dim=1).float(), k_mean=mean.float(),
                       k_inv_scale=(1.0 / scale).float())
