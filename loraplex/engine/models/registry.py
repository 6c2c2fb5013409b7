"""Which model families the engine serves, keyed by Hugging Face architecture (and GGUF arch name).

Loaders ask `family_for_hf` / `family_for_gguf` whether a checkpoint is servable (an unknown one is
refused by name, listing the supported ones); the model asks its family whether the CPU kernels'
fused decode step serves it. Adding a Llama-like family is one `register` call.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.models.llama import LlamaModel


@dataclass(frozen=True)
class ModelFamily:
    """One servable architecture and how the engine treats it.

    - architecture: the HF `architectures[0]` name (config.json), also LlamaConfig.architecture
    - gguf_arch: GGUF `general.architecture` that loads as this family, or None (no GGUF of its own)
    - qkv_bias_default: whether q/k/v carry a bias when config.json does not say (`attention_bias`)
    - fused_cpu_decode: whether the C fused decode step (kernels/cpu/decode_step.c) serves it; when
      False an all-decode step on the CPU kernels runs layer by layer like any other step
    - model: the class built from (LlamaConfig, weights)
    """

    architecture: str
    gguf_arch: str | None
    qkv_bias_default: bool
    fused_cpu_decode: bool
    model: type = LlamaModel


_BY_HF: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Adds (or replaces) the family for its HF architecture; two families may not claim one GGUF arch."""
    if family.gguf_arch is not None:
        for other in _BY_HF.values():
            if other.gguf_arch == family.gguf_arch and other.architecture != family.architecture:
                raise ValueError(f"GGUF architecture {family.gguf_arch!r} already loads as {other.architecture}")
    _BY_HF[family.architecture] = family
    return family


def unregister(architecture: str) -> None:
    """Removes a family (tests that register a temporary one clean up with this)."""
    _BY_HF.pop(architecture, None)


def families() -> tuple[ModelFamily, ...]:
    """Every registered family, in registration order."""
    return tuple(_BY_HF.values())


def _refuse(kind: str, arch: str | None, source: str, supported: list[str]) -> ValueError:
    where = f"{source}: " if source else ""
    return ValueError(f"{where}{kind}architecture {arch!r} is not supported (supported: {', '.join(supported)})")


def family_for_hf(arch: str | None, source: str = "") -> ModelFamily:
    """The family of an HF architecture name; ValueError naming it (prefixed by `source`) if unknown."""
    family = _BY_HF.get(arch) if arch is not None else None
    if family is None:
        raise _refuse("", arch, source, list(_BY_HF))
    return family


def family_for_gguf(arch: str | None, source: str = "") -> ModelFamily:
    """The family a GGUF `general.architecture` loads as; ValueError naming it (prefixed by `source`) if unknown."""
    for family in _BY_HF.values():
        if arch is not None and family.gguf_arch == arch:
            return family
    raise _refuse("GGUF ", arch, source, [f.gguf_arch for f in _BY_HF.values() if f.gguf_arch is not None])


LLAMA = register(ModelFamily("LlamaForCausalLM", gguf_arch="llama", qkv_bias_default=False, fused_cpu_decode=True))
# Mistral GGUFs say "llama" (same tensors and rope layout): they load as the Llama family.
MISTRAL = register(ModelFamily("MistralForCausalLM", gguf_arch=None, qkv_bias_default=False, fused_cpu_decode=True))
QWEN2 = register(ModelFamily("Qwen2ForCausalLM", gguf_arch="qwen2", qkv_bias_default=True, fused_cpu_decode=True))
