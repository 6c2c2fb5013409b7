"""PEFT LoRA adapters for Llama-family models: parse a PEFT directory and validate it against the base model.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors` with, per decoder layer
and target module, `lora_A.weight` [r, in_features] and `lora_B.weight` [out_features, r]; the delta is
scaling * B @ A with scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). Everything is checked
here, before an adapter reaches a device slot, so a bad upload fails with one error naming the field or
tensor and never mid-batch. Pickled weights (.bin, .pt, ...) are refused: loading them runs code.
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import torch

from loraplex.engine.api import PEFT_CONFIG_FILE as CONFIG_FILE
from loraplex.engine.api import PEFT_WEIGHTS_FILE as WEIGHTS_FILE
from loraplex.engine.api import InvalidRequestError, missing_weights_reason
from loraplex.engine.lora.st_reader import Entry, flat_view, parse_safetensors, read_file, view
from loraplex.engine.models.llama import LlamaConfig

# Short names (internal) in canonical order, with PEFT's module names and their parent block.
MODULES = ("q", "k", "v", "o", "gate", "up", "down")
PEFT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_SHORT = {p: s for s, p in PEFT_NAMES.items()}
_PARENT = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
           "gate": "mlp", "up": "mlp", "down": "mlp"}
# Fused projections of llama.py, each a stack of modules in row order.
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.([\w-]+))?\.weight\Z")
# Inits that rewrite the base weights (residual W - BA); such an adapter is only valid on that modified base.
_RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterError(InvalidRequestError):
    """An adapter cannot be used with this base model; nothing was registered or loaded."""

    code = "invalid_adapter"

    def __init__(self, message: str, param: str | None = "adapter"):
        super().__init__(message, param)


class AdapterNotFoundError(AdapterError):
    code = "adapter_not_found"


class AdapterInUseError(AdapterError):
    """The adapter is acquired by running requests; retry once they release it."""

    code = "adapter_in_use"


def module_dims(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-targetable module."""
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def fused_rows(config: LlamaConfig, fused: str) -> list[tuple[str, int, int]]:
    """(module, row offset, width) of each module inside fused projection `fused` (qkv, o, gate_up, down)."""
    dims, rows, off = module_dims(config), [], 0
    for m in FUSED[fused]:
        rows.append((m, off, dims[m][1]))
        off += dims[m][1]
    return rows


@dataclass
class LoraWeights:
    """One parsed, validated adapter: every A and B, fp32 on CPU, unscaled (as PEFT stores them), in one
    flat tensor. That is usually a view of the file's bytes as read (`buffer`), so a load makes no torch
    object per tensor; `a()` and `b()` give views."""

    rank: int  # the largest of its modules' ranks: what a slot must hold
    alpha: float
    scaling: float  # of the modules rank_pattern and alpha_pattern leave at r and lora_alpha
    target_modules: tuple[str, ...]  # short names, in MODULES order
    layers: tuple[int, ...]  # decoder layers that carry deltas
    values: torch.Tensor = field(repr=False)  # flat fp32 holding every A [rank, in] and B [out, rank], row-major
    # (layer, module) -> A's, B's start in values; read-only, shared by the adapters of one header and shape
    offsets: Mapping[tuple[int, str], tuple[int, int]] = field(repr=False)
    dims: dict[str, tuple[int, int]] = field(repr=False)  # module -> (in_features, out_features)
    use_rslora: bool = False
    path: str = ""
    buffer: torch.Tensor | None = field(default=None, repr=False)  # the file's bytes `values` views, if it does
    # Per (layer, module), where rank_pattern / alpha_pattern set them; None: every module at rank / scaling.
    module_ranks: Mapping[tuple[int, str], int] | None = field(default=None, repr=False)
    module_scalings: Mapping[tuple[int, str], float] | None = field(default=None, repr=False)
    version: tuple = ()  # files_version() of the files it was read from

    def rank_of(self, layer: int, module: str) -> int:
        return self.rank if self.module_ranks is None else self.module_ranks[(layer, module)]

    def scaling_of(self, layer: int, module: str) -> float:
        return self.scaling if self.module_scalings is None else self.module_scalings[(layer, module)]

    def a(self, layer: int, module: str) -> torch.Tensor:
        """A [rank, in] of a targeted (layer, module) (KeyError otherwise), at that module's rank."""
        start, in_f, r = self.offsets[(layer, module)][0], self.dims[module][0], self.rank_of(layer, module)
        return self.values[start:start + r * in_f].view(r, in_f)

    def b(self, layer: int, module: str) -> torch.Tensor:
        """B [out, rank] of a targeted (layer, module) (KeyError otherwise), at that module's rank."""
        start, out_f, r = self.offsets[(layer, module)][1], self.dims[module][1], self.rank_of(layer, module)
        return self.values[start:start + out_f * r].view(out_f, r)

    def delta(self, layer: int, module: str) -> torch.Tensor | None:
        """scaling * B @ A [out, in] in fp32, or None where the adapter leaves the module alone."""
        if (layer, module) not in self.offsets:
            return None
        return self.scaling_of(layer, module) * (self.b(layer, module) @ self.a(layer, module))


def load_peft_adapter(path: str | Path, config: LlamaConfig, max_rank: int = 64,
                      buffer: torch.Tensor | None = None) -> LoraWeights:
    """Parses and validates the PEFT LoRA directory at `path` for base model `config`.

    `buffer`: a flat uint8 tensor whose memory the file may be read into (read_file), so a caller
    that owns an evicted adapter's buffer can recycle it; the result's `buffer` says whether it did.
    Raises AdapterError naming the first bad file, field or tensor.
    """
    root = Path(path).expanduser()
    where = f"adapter {str(path)!r}"
    if not root.is_dir():
        raise AdapterError(f"{where}: not a directory (expected {CONFIG_FILE} and {WEIGHTS_FILE} inside)")
    before = files_version(root)
    cfg = _read_config(root, where)
    shape = _check_config(cfg, config, max_rank, where)
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{where}: {missing_weights_reason(root)}")
    values, offsets, data = _read_tensors(weights, config, shape, where, buffer)
    version = files_version(root)
    if version != before:
        raise AdapterError(f"{where}: its files changed while they were read; load it again once they are written")
    return LoraWeights(rank=shape.rank, alpha=shape.alpha, scaling=shape.scaling, target_modules=shape.targets,
                       layers=shape.layers, values=values, offsets=offsets, dims=module_dims(config),
                       use_rslora=shape.rslora, path=str(root),
                       buffer=data if values.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
                       else None, module_ranks=shape.ranks, module_scalings=shape.scalings, version=version)


def files_version(root: Path) -> tuple:
    """(inode, size, mtime) of each of the adapter's two files (None where one is missing): what tells
    one version of them from the next. Writing a file changes its mtime and replacing it its inode;
    moving the directory changes neither."""
    version = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (root / name).stat()
        except OSError:
            version.append(None)
        else:
            version.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(version)


def _read_config(root: Path, where: str) -> dict:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{where}: {CONFIG_FILE} is missing")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Shape(NamedTuple):
    """What the config says of the adapter: its largest rank, r's scaling, targets, layers, and where
    rank_pattern / alpha_pattern set them, each (layer, module)'s rank and scaling (else None)."""

    rank: int
    alpha: float
    scaling: float
    rslora: bool
    targets: tuple[str, ...]
    layers: tuple[int, ...]
    ranks: Mapping[tuple[int, str], int] | None
    scalings: Mapping[tuple[int, str], float] | None

    def rank_of(self, layer: int, module: str) -> int:
        return self.rank if self.ranks is None else self.ranks[(layer, module)]


def _check_config(cfg: dict, config: LlamaConfig, max_rank: int, where: str) -> _Shape:
    """The adapter's shape, or raises naming the field."""
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type is {peft_type!r}; only 'LORA' adapters are supported")
    r = cfg.get("r")
    if not _is_int(r) or not 1 <= r <= max_rank:
        raise AdapterError(f"{where}: r must be an integer in [1, {max_rank}] (max_lora_rank), got {r!r}")
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{where}: lora_alpha must be a positive number, got {alpha!r}"
                           if "lora_alpha" in cfg else f"{where}: lora_alpha is missing")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{where}: use_rslora must be true or false, got {rslora!r}")
    _check_unsupported(cfg, where)
    targets = _parse_targets(cfg.get("target_modules"), where)
    layers = _parse_layers(cfg, config.num_layers, where)
    ranks, alphas = (_per_module(cfg, name, default, targets, layers, max_rank, where)
                     for name, default in (("rank_pattern", r), ("alpha_pattern", alpha)))

    def scaling_at(rank: int, a: float) -> float:
        return float(a / math.sqrt(rank) if rslora else a / rank)

    if ranks is None and alphas is None:
        return _Shape(r, float(alpha), scaling_at(r, alpha), rslora, targets, layers, None, None)
    keys = [(layer, m) for layer in layers for m in targets]
    ranks = ranks or dict.fromkeys(keys, r)
    scalings = {k: scaling_at(ranks[k], alphas[k] if alphas else alpha) for k in keys}
    return _Shape(max(ranks.values()), float(alpha), scaling_at(r, alpha), rslora, targets, layers,
                  MappingProxyType(ranks), MappingProxyType(scalings))


def _per_module(cfg: dict, name: str, default: float, targets: tuple[str, ...], layers: tuple[int, ...],
                max_rank: int, where: str) -> dict[tuple[int, str], float] | None:
    """Each targeted (layer, module)'s value under rank_pattern or alpha_pattern (`name`), as PEFT reads
    them: the first pattern key, in the file's order (PEFT writes it sorted), that as a regex matches the
    module's whole name or a dotted suffix of it (e.g. "q_proj", "layers.0.self_attn.q_proj", "mlp\\..*"),
    gives its value; default elsewhere. None when the field is absent or empty."""
    patterns = cfg.get(name)
    if not patterns:
        return None
    if not isinstance(patterns, dict):
        raise AdapterError(f"{where}: {name} must map module name patterns to values, got {patterns!r}")
    compiled = []
    for key, value in patterns.items():
        if name == "rank_pattern" and not (_is_int(value) and 1 <= value <= max_rank):
            raise AdapterError(f"{where}: {name}[{key!r}] must be an integer in [1, {max_rank}] (max_lora_rank), "
                               f"got {value!r}")
        if name == "alpha_pattern" and (isinstance(value, bool) or not isinstance(value, int | float)
                                        or not math.isfinite(value) or value <= 0):
            raise AdapterError(f"{where}: {name}[{key!r}] must be a positive number, got {value!r}")
        _check_pattern_key(key, name, where)
        try:
            compiled.append((re.compile(rf"(.*\.)?({key})\Z"), value))
        except re.error as e:
            raise AdapterError(f"{where}: {name} key {key!r} is not a valid pattern: {e}") from None
    out = {}
    for layer in layers:
        for m in targets:
            full = f"model.layers.{layer}.{_PARENT[m]}.{PEFT_NAMES[m]}"
            out[(layer, m)] = next((v for rx, v in compiled if rx.match(full)), default)
    return out


# A rank_pattern / alpha_pattern key is a regular expression (as PEFT matches it); a quantifier on a
# group ("(a+)+", "(a|a)*") can backtrack exponentially, so such keys and long ones are refused.
MAX_PATTERN_KEY_CHARS = 256
_GROUP_QUANTIFIED = re.compile(r"\)[*+{]")  # ("(1|2)?" is fine: at most once)


def _check_pattern_key(key: object, name: str, where: str) -> None:
    if not isinstance(key, str) or not key or len(key) > MAX_PATTERN_KEY_CHARS:
        raise AdapterError(f"{where}: {name} keys must be module name patterns of 1 to {MAX_PATTERN_KEY_CHARS} "
                           "characters")
    if _GROUP_QUANTIFIED.search(key):
        raise AdapterError(f"{where}: {name} key {key[:64]!r} repeats a group; only module names and simple "
                           "patterns are supported")


def _check_unsupported(cfg: dict, where: str) -> None:
    """LoRA variants whose math is not W + scaling * B @ A on the seven projections are refused."""
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(f"{where}: bias is {bias!r}; only 'none' is supported (bias terms are not served)")
    refused = {  # field: why; refused when the field is set (true, non-empty)
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style transposed weights) is not supported for Llama",
        "modules_to_save": "fully trained modules (modules_to_save) are not supported, only LoRA deltas",
        "exclude_modules": "exclude_modules is not supported; list the target modules instead",
        "layer_replication": "layer_replication is not supported",
        "lora_bias": "lora_bias (a bias on lora_B) is not supported",
        "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
        "trainable_token_indices": "trainable token embeddings are not supported",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
        "use_qalora": "QALoRA is not supported",
        "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
        "arrow_config": "Arrow routing is not supported",
        "kasa_config": "KaSA adapters are not supported",
        "monteclora_config": "MonteCLoRA adapters are not supported",
        "loftq_config": "LoftQ adapters need their quantized base model and are not supported",
    }
    for name, why in refused.items():
        if cfg.get(name):
            raise AdapterError(f"{where}: {name} is set ({cfg[name]!r}); {why}")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_RESIDUAL_INITS):
        raise AdapterError(f"{where}: init_lora_weights is {init!r}, which modifies the base weights; save the "
                           "adapter with path_initial_model_for_weight_conversion to get a plain LoRA")


def _parse_targets(value: object, where: str) -> tuple[str, ...]:
    supported = ", ".join(PEFT_NAMES.values())
    if value is None:
        raise AdapterError(f"{where}: target_modules is missing")
    if isinstance(value, str):
        if value == "all-linear":
            return MODULES
        if value not in _SHORT:
            if re.fullmatch(r"\w+", value):
                raise AdapterError(f"{where}: target module {value!r} is not supported (supported: {supported})")
            raise AdapterError(f"{where}: target_modules is a regex pattern ({value!r}); regex targets are not "
                               f"supported, list module names ({supported}) instead")
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        raise AdapterError(f"{where}: target_modules must be a non-empty list of module names, got {value!r}")
    for name in value:
        if name not in _SHORT:
            raise AdapterError(f"{where}: target module {name!r} is not supported (supported: {supported})")
    return tuple(m for m in MODULES if PEFT_NAMES[m] in value)


def _parse_layers(cfg: dict, num_layers: int, where: str) -> tuple[int, ...]:
    value = cfg.get("layers_to_transform")
    if value is None:
        return tuple(range(num_layers))
    items = [value] if _is_int(value) else value
    if not isinstance(items, list) or not items or not all(_is_int(i) for i in items):
        raise AdapterError(f"{where}: layers_to_transform must be an integer or a non-empty list of integers, "
                           f"got {value!r}")
    bad = [i for i in items if not 0 <= i < num_layers]
    if bad:
        raise AdapterError(f"{where}: layers_to_transform has layer {bad[0]}, but the base model has "
                           f"{num_layers} layers (0..{num_layers - 1})")
    pattern = cfg.get("layers_pattern")
    if pattern not in (None, "layers", ["layers"]):
        raise AdapterError(f"{where}: layers_pattern {pattern!r} does not name Llama's decoder layers ('layers')")
    return tuple(sorted(set(items)))


def _key_of(layer: int, module: str, ab: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{PEFT_NAMES[module]}.lora_{ab}.weight"


def _read_tensors(file: Path, config: LlamaConfig, shape: _Shape, where: str, buffer: torch.Tensor | None
                  ) -> tuple[torch.Tensor, Mapping[tuple[int, str], tuple[int, int]], torch.Tensor]:
    """(values, offsets, the file's bytes): A and B of every (layer, module), each checked for name, shape,
    dtype and finiteness, in one flat fp32 tensor (a view of the file's bytes when they are fp32)."""
    try:  # one read of the whole file; the header is checked as plain values
        data = read_file(file, into=buffer)
        entries, region = parse_safetensors(data)
    except ValueError as e:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} cannot be read as safetensors: {e}") from None
    ranks = _rank_table(shape)
    layout = _expected_layout(entries, config, ranks)  # (complete when not None)
    if layout is None:  # an unusual or bad file: every tensor checked by name, to say what is wrong
        found = _read_checked(entries, where, config, shape)
        _check_complete(found, shape.targets, shape.layers, where)
        layout = _layout(found)
    values, offsets = _as_values(layout, entries, region)
    _check_finite(values, offsets, layout.found, where)
    return values, offsets, data


def _check_complete(found: dict[str, dict[tuple[int, str], Entry]], targets: tuple[str, ...],
                    layers: tuple[int, ...], where: str) -> None:
    """Every targeted (layer, module) has both its A and its B."""
    for layer in layers:
        for module in targets:
            has_a, has_b = (layer, module) in found["A"], (layer, module) in found["B"]
            if has_a != has_b:
                missing = "B" if has_a else "A"
                raise AdapterError(f"{where}: tensor {_key_of(layer, module, missing)!r} is missing "
                                   f"({PEFT_NAMES[module]} of layer {layer} has lora_{'A' if has_a else 'B'} only)")
            if not has_a:
                raise AdapterError(f"{where}: tensor {_key_of(layer, module, 'A')!r} (and its lora_B) is missing: "
                                   f"target_modules lists {PEFT_NAMES[module]} for layer {layer}")


class _Layout(NamedTuple):
    """Where an adapter's tensors are: its A and B entries by (layer, module), and each pair's (A, B) start
    among the floats of the values (read-only), as the file's own data region when that is one fp32 tensor
    (`flat`) or as _as_values packs a converted copy, each pair back to back (`packed`)."""

    found: dict[str, dict[tuple[int, str], Entry]]  # "A" / "B" -> (layer, module) -> entry
    flat: Mapping[tuple[int, str], tuple[int, int]]
    packed: Mapping[tuple[int, str], tuple[int, int]]


def _layout(found: dict[str, dict[tuple[int, str], Entry]]) -> _Layout:
    packed, at = {}, 0
    for key, a in found["A"].items():
        packed[key] = (at, at + a.numel)
        at += a.numel + found["B"][key].numel
    flat = {key: (a.begin // 4, found["B"][key].begin // 4) for key, a in found["A"].items()}
    return _Layout(found, MappingProxyType(flat), MappingProxyType(packed))


# ((layer, module), rank) of every targeted module, in layer then MODULES order: hashable, for the caches.
_RankTable = tuple[tuple[tuple[int, str], int], ...]


def _rank_table(shape: _Shape) -> _RankTable:
    return tuple(((layer, m), shape.rank_of(layer, m)) for layer in shape.layers for m in shape.targets)


# Adapters of one shape have byte-identical headers, which st_reader parses into one shared entries
# mapping; their layout is worked out once too, so a fleet's loads skip matching hundreds of entries and
# share one offsets mapping, on which the slots key their block tables (slots._slot_blocks).
_LAYOUTS_KEPT = 32
_layouts: OrderedDict[tuple, tuple[Mapping[str, Entry], _Layout]] = OrderedDict()
_layouts_lock = threading.Lock()


def _expected_layout(entries: Mapping[str, Entry], config: LlamaConfig,
                     ranks: _RankTable) -> _Layout | None:
    """The layout of a file holding exactly the expected tensors (_found_as_expected), kept per parsed
    header and adapter shape (`ranks`: _rank_table); None for any other file (not kept)."""
    key = (id(entries), ranks, tuple(module_dims(config).items()))
    with _layouts_lock:
        kept = _layouts.get(key)
        if kept is not None and kept[0] is entries:  # (the mapping is held, so its id is not reused)
            _layouts.move_to_end(key)
            return kept[1]
    found = _found_as_expected(entries, config, ranks)
    if found is None:
        return None
    layout = _layout(found)
    with _layouts_lock:
        _layouts[key] = (entries, layout)
        while len(_layouts) > _LAYOUTS_KEPT:
            _layouts.popitem(last=False)
    return layout


def _as_values(layout: _Layout, entries: Mapping[str, Entry],
               region: torch.Tensor) -> tuple[torch.Tensor, Mapping[tuple[int, str], tuple[int, int]]]:
    """One flat fp32 tensor holding every A and B, and each pair's offsets in it: the file's data region
    itself when it is all fp32 (no copy), else a converted copy with the tensors back to back."""
    flat = flat_view(region, entries)
    if flat is not None and flat.dtype == torch.float32:
        return flat, layout.flat
    found = layout.found
    values = torch.empty(sum(e.numel for part in found.values() for e in part.values()), dtype=torch.float32)
    for key, a in found["A"].items():
        for e, at in zip((a, found["B"][key]), layout.packed[key], strict=True):
            values[at:at + e.numel].view(e.shape).copy_(view(region, e))
    return values, layout.packed


def _check_finite(values: torch.Tensor, offsets: Mapping[tuple[int, str], tuple[int, int]],
                  found: dict[str, dict[tuple[int, str], Entry]], where: str) -> None:
    """One pass over every value; only when that fails are tensors checked one by one, to name the culprit."""
    # NaN and Inf propagate through a sum, so a finite sum proves every value finite; a non-finite
    # one (possibly mere overflow) falls through to the exact per-tensor check.
    if bool(values.sum().isfinite()):
        return
    for key, starts in sorted(offsets.items()):
        for ab, start in zip("AB", starts, strict=True):
            if not bool(torch.isfinite(values[start:start + found[ab][key].numel]).all()):
                raise AdapterError(f"{where}: tensor {_key_of(*key, ab)!r} holds non-finite values (NaN or Inf)")


@functools.lru_cache(maxsize=64)
def _expected_tensors(dims: tuple[tuple[str, tuple[int, int]], ...],
                      ranks: _RankTable
                      ) -> dict[str, tuple[str, tuple[int, str], tuple[int, ...]]]:
    """name -> ("A" or "B", (layer, module), shape) of every tensor of an adapter of this shape (`ranks`:
    _rank_table), under the names PEFT saves (adapters of one shape share the table)."""
    dim = dict(dims)
    return {_key_of(layer, module, ab): (ab, (layer, module), (r, dim[module][0]) if ab == "A"
                                         else (dim[module][1], r))
            for (layer, module), r in ranks for ab in "AB"}


def _found_as_expected(entries: Mapping[str, Entry], config: LlamaConfig,
                       ranks: _RankTable) -> dict[str, dict[tuple[int, str], Entry]] | None:
    """What _read_checked returns, for a file holding exactly the expected tensors under PEFT's names with the
    right shapes and dtypes (so none is missing): one dict lookup per tensor (an adapter has hundreds). None
    for any other file."""
    expected = _expected_tensors(tuple(module_dims(config).items()), ranks)
    if len(entries) != len(expected):
        return None
    found: dict[str, dict[tuple[int, str], Entry]] = {"A": {}, "B": {}}
    for name, entry in entries.items():
        want = expected.get(name)
        if want is None or entry.shape != want[2] or entry.dtype not in _DTYPE_NAMES:
            return None
        found[want[0]][want[1]] = entry
    return found


def _read_checked(entries: Mapping[str, Entry], where: str, config: LlamaConfig,
                  shape: _Shape) -> dict[str, dict[tuple[int, str], Entry]]:
    """Every tensor of the file, keyed "A"/"B" -> (layer, module), each checked before use."""
    dims, targets, layers = module_dims(config), shape.targets, shape.layers
    found: dict[str, dict[tuple[int, str], Entry]] = {"A": {}, "B": {}}
    adapter_names: set[str | None] = set()
    for key in sorted(entries):
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA A/B weight of a decoder layer projection "
                               "(lm_head, embeddings, biases and DoRA magnitudes are not supported)")
        layer, parent, peft_name, ab, adapter_name = int(m[1]), m[2], m[3], m[4], m[5]
        module = _SHORT.get(peft_name)
        if module is None or _PARENT[module] != parent:
            raise AdapterError(f"{where}: tensor {key!r} is for an unknown module {parent}.{peft_name}")
        if layer >= config.num_layers:
            raise AdapterError(f"{where}: tensor {key!r} is for layer {layer}, but the base model has "
                               f"{config.num_layers} layers")
        if module not in targets:
            raise AdapterError(f"{where}: tensor {key!r} is for {peft_name}, which is not in target_modules")
        if layer not in layers:
            raise AdapterError(f"{where}: tensor {key!r} is for layer {layer}, which is not in layers_to_transform")
        adapter_names.add(adapter_name)
        if len(adapter_names) > 1:
            raise AdapterError(f"{where}: tensor {key!r} names adapter {adapter_name!r} but other tensors do not "
                               "(one adapter per file)")
        in_f, out_f = dims[module]
        rank = shape.rank_of(layer, module)
        expected = (rank, in_f) if ab == "A" else (out_f, rank)
        entry = entries[key]
        if entry.shape != expected:
            whose = "" if shape.ranks is None else " as rank_pattern sets it"
            raise AdapterError(f"{where}: tensor {key!r} has shape {list(entry.shape)}, expected {list(expected)} "
                               f"(r={rank}{whose}; {peft_name} is {in_f} -> {out_f} in the base model)")
        if entry.dtype not in _DTYPE_NAMES:
            dtype = str(entry.dtype).removeprefix("torch.")
            raise AdapterError(f"{where}: tensor {key!r} has dtype {dtype}; expected float16, bfloat16 or float32")
        found[ab][(layer, module)] = entry
    return found
