"""One adapter merged into a copy of the projection weights, for decode steps whose every token uses it.

- Such a step then runs as the base model does: the same GEMMs over W' = W + scaling * B @ A and no LoRA work at all
  (dLoRA's "merged mode", OSDI '24). At 32 sequences on one rank-16 adapter the fused decode step's LoRA work, even
  folded into the GEMMs, costs 4-7% of the step; merged it costs nothing.
- The price is a packed copy of every targeted projection (for SmolLM2-135M in fp32, 420 MB with all seven modules
  targeted) and a build of a few hundred milliseconds. So the copy is made only once one adapter has held every token
  of `after_steps` fused decode steps in a row; one copy is kept, and it goes when its slot is rewritten or another
  adapter earns the merge.
- CPU fused decode step only (kernels/cpu/decode_step.py, fp32); the per-op path (prefill, mixed steps) and the GPU
  keep the LoRA kernels.
- The copy is packed without an unpacked weight, in the base's packed element type, or bf16 over a block-quantized
  base (W + BA has no blocks of its own; bf16 keeps the adapter's delta, which re-quantizing would round away).
"""

from __future__ import annotations

import logging
import time

import torch

from loraplex.engine.kernels.cpu.linear import BLOCK_KINDS, pack
from loraplex.engine.kernels.lora_ops import LoraBatchIndex
from loraplex.engine.lora.slots import LoraSlots
from loraplex.engine.models.llama import PROJECTIONS, LayerWeights
from loraplex.engine.quant import BlockWeight, dequantize

log = logging.getLogger(__name__)


class MergedAdapter:
    """Decides when a decode step runs on merged weights and keeps the one merged copy."""

    def __init__(self, model, slots: LoraSlots, after_steps: int):
        if after_steps < 1:
            raise ValueError(f"after_steps must be >= 1, got {after_steps}")
        self.model, self.slots, self.after_steps = model, slots, after_steps
        self._key: tuple[int, int] | None = None  # (slot, slot write) the copy was made from
        self._layers: list[LayerWeights] | None = None
        self._streak: tuple[tuple[int, int] | None, int] = (None, 0)  # (slot, write), all-on-it steps in a row
        self.builds = 0
        self.last_build_ms = 0.0
        self.steps = 0  # decode steps run on a merged copy

    def layers_for(self, index: LoraBatchIndex) -> list[LayerWeights] | None:
        """The model's layers (LlamaModel.layers) with the step's adapter merged, when every token
        of this fused decode step uses one slot and that adapter has earned its copy; else None."""
        if self._key is not None and self.slots.writes[self._key[0]] != self._key[1]:
            self._drop()  # its slot now holds another adapter (or was cleared)
        slots = {slot for _, _, slot in index.lora_segments}
        if len(slots) != 1 or index.num_lora_tokens != index.num_tokens:
            self._streak = (None, 0)
            return None
        slot = slots.pop()
        key = (slot, self.slots.writes[slot])
        if key != self._key:
            seen, steps = self._streak
            steps = steps + 1 if seen == key else 1
            self._streak = (key, steps)
            if steps < self.after_steps:
                return None
            self._build(key)
        self.steps += 1
        return self._layers

    def nbytes(self) -> int:
        """Memory of the merged copy (projections the adapter leaves alone are shared with the model)."""
        if self._layers is None:
            return 0
        pairs = zip(self._layers, self.model.layers, strict=True)
        copies = [w for layer, base in pairs for m in PROJECTIONS if (w := getattr(layer, m)) is not getattr(base, m)]
        return sum(w.data.numel() * w.data.element_size() for w in copies)

    def _drop(self) -> None:
        self._key, self._layers = None, None

    def _build(self, key: tuple[int, int]) -> None:
        t0 = time.perf_counter()
        self._drop()  # the old copy's memory goes before the new one is made
        slot = key[0]
        scratch: dict[tuple[int, ...], torch.Tensor] = {}  # one unpacked W' per shape, reused layer to layer
        layers = []
        for li, base_layer in enumerate(self.model.layers):
            merged = {}
            for module in PROJECTIONS:
                base = self.model.w[f"layers.{li}.{module}"]  # [out, in]
                if isinstance(base, BlockWeight):
                    base = dequantize(base)
                out = scratch.setdefault(tuple(base.shape), torch.empty_like(base))
                if self.slots.merged_weight(li, module, slot, base, out):
                    packed = getattr(base_layer, module)
                    dtype = torch.bfloat16 if packed.kind in BLOCK_KINDS else packed.data.dtype
                    merged[module] = pack(out, keep_weight=False, dtype=dtype)
            layers.append(base_layer._replace(**merged))
        self._key, self._layers = key, layers
        self.builds += 1
        self.last_build_ms = (time.perf_counter() - t0) * 1000
        log.info("merged the adapter in slot %d into the decode step's weights (%.0f MB, %.0f ms)",
                 slot, self.nbytes() / 2**20, self.last_build_ms)
