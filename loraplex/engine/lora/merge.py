"""An adapter merged into the base weights: W' = W + scaling * B @ A on the rows of each fused projection.

Serving never merges (many adapters share one base); this is the reference that multi-LoRA output is
checked against ("the same adapter merged into the weights and run alone"), and a way to export a merge.
"""

from __future__ import annotations

import torch

from loraplex.engine.lora.peft import FUSED, LoraWeights, fused_rows
from loraplex.engine.models.llama import LlamaConfig


def merged_weights(base_weights: dict[str, torch.Tensor], config: LlamaConfig,
                   lora: LoraWeights) -> dict[str, torch.Tensor]:
    """A new weight dict (internal names, see llama.py) with `lora` merged; `base_weights` is not modified.

    Untouched tensors are shared with `base_weights`; merged ones are new, summed in fp32 and cast back
    to the base dtype and device.
    """
    merged = dict(base_weights)
    for layer in lora.layers:
        for fused in FUSED:
            name = f"layers.{layer}.{fused}"
            base = base_weights[name]  # [sum of module widths, in]
            w = None
            for module, off, width in fused_rows(config, fused):
                delta = lora.delta(layer, module)  # [width, in] fp32 or None
                if delta is None:
                    continue
                if w is None:
                    w = base.to(torch.float32, copy=True)
                w[off:off + width] += delta.to(w.device)
            if w is not None:
                merged[name] = w.to(base.dtype)
    return merged
