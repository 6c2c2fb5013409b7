"""GGUF file -> LlamaConfig, weights in llama.py's internal naming, and the Tokenizer.

- With keep_blocks, Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K matrices stay in their blocks (engine/quant.py
  BlockWeight, the bytes the file holds); every other tensor, and every tensor without keep_blocks, is
  dequantized to fp32 with gguf's own numpy kernels.
- The result is cached as safetensors (config, tokenizer and the blocks' formats in its header; one file
  per mode), so every later load is an mmap: no metadata parse (GGUFReader alone takes seconds on a
  49k-token vocab) and no dequantization.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraplex.engine.config import default_cache_dir
from loraplex.engine.models.llama import LlamaConfig, rope_inv_freq
from loraplex.engine.models.registry import family_for_gguf
from loraplex.engine.models.tokenizer import Tokenizer
from loraplex.engine.quant import BlockWeight, dequantize

log = logging.getLogger(__name__)

# Bump when the conversion below changes, so stale caches are not reused (2: the config holds its architecture;
# 3: K-quant matrices kept as blocks).
CACHE_VERSION = 3


def open_gguf(path: str | Path):
    """A GGUFReader, or a ValueError naming the file when it is not a complete GGUF."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader fails with assorted numpy errors on truncated files
        raise ValueError(f"{path}: not a valid or complete GGUF file ({type(e).__name__}: {e})") from e


# GGUF tensor types kept as blocks with keep_blocks (their quant.BLOCK_BYTES names)
KEPT_BLOCKS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


def load_gguf(path: str | Path, cache_dir: str | Path | None = None,
              keep_blocks: bool = False) -> tuple[LlamaConfig, dict, Tokenizer]:
    """(config, weights, tokenizer) for a GGUF, from the cache when it holds this file: fp32 tensors, and
    with keep_blocks BlockWeights for the matrices stored in KEPT_BLOCKS' formats."""
    path = Path(path)
    cache = _cache_file(path, Path(cache_dir) if cache_dir is not None else default_cache_dir(), keep_blocks)
    hit = _read_cache(cache)
    if hit is not None:
        return hit
    reader = open_gguf(path)
    try:
        config = gguf_config(reader)
        tokenizer = Tokenizer.from_gguf(reader)
        weights = gguf_weights(reader, config, keep_blocks)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    except (KeyError, TypeError, RuntimeError, NotImplementedError) as e:  # missing keys, odd quant types
        raise ValueError(f"{path}: unsupported GGUF contents ({type(e).__name__}: {e})") from e
    _write_cache(cache, config, weights, tokenizer)
    return config, weights, tokenizer


def gguf_tokenizer(path: str | Path, cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer alone, as load_gguf gives it: from the cache's metadata when it holds this file (no weights
    read; either mode's cache), else parsed from the GGUF."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    for cache in (_cache_file(Path(path), root, keep) for keep in (True, False)):
        if not cache.is_file():
            continue
        try:
            with safe_open(str(cache), framework="pt") as f:
                return Tokenizer.from_json(f.metadata()["tokenizer"])
        except Exception as e:  # an unreadable cache is only a miss
            log.warning("ignoring unreadable model cache %s: %s", cache, e)
    try:
        return Tokenizer.from_gguf(open_gguf(path))
    except (KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"{path}: unsupported GGUF contents ({type(e).__name__}: {e})") from e


def gguf_config(reader) -> LlamaConfig:
    """LlamaConfig from `{arch}.*` metadata; tensor shapes decide vocab, tying and biases."""
    fields = reader.fields

    def get(key, default=None):
        f = fields.get(key)
        return f.contents() if f is not None else default

    arch = get("general.architecture")
    family = family_for_gguf(arch)  # (refuses an unknown one, naming the supported ones; load_gguf names the file)
    names = {t.name: t for t in reader.tensors}
    default_eps = 1e-6 if arch == "qwen2" else 1e-5
    hidden = get(f"{arch}.embedding_length")
    heads = get(f"{arch}.attention.head_count")
    head_dim = get(f"{arch}.attention.key_length") or hidden // heads
    rope_dim = get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"GGUF: partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    config = LlamaConfig(
        vocab_size=int(names["token_embd.weight"].shape[1]),  # GGUF shapes are [cols, rows]
        hidden_size=hidden,
        intermediate_size=get(f"{arch}.feed_forward_length"),
        num_layers=get(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=get(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", default_eps)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=get(f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        architecture=family.architecture,
    )
    scaling = get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF: rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in names:
        config = _with_llama3_scaling(config, _dequantize(names["rope_freqs.weight"]))
    return config


def _with_llama3_scaling(config: LlamaConfig, freqs: torch.Tensor) -> LlamaConfig:
    """llama.cpp stores Llama 3.1 RoPE scaling as per-frequency divisors (rope_freqs.weight);
    recover the HF parameters by trying the ones every Llama 3.x release uses."""
    base = rope_inv_freq(config)  # [head_dim / 2]
    rope = {"rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    scaled = dataclasses.replace(config, rope_scaling=rope)
    if not torch.allclose((base / rope_inv_freq(scaled)).float(), freqs.flatten(), rtol=1e-3):
        raise ValueError("GGUF: rope_freqs.weight does not match Llama 3 rope scaling; not supported")
    return scaled


def gguf_weights(reader, config: LlamaConfig, keep_blocks: bool = False) -> dict[str, torch.Tensor | BlockWeight]:
    """Weights in internal naming (fp32, or with keep_blocks the matrices in KEPT_BLOCKS' formats as blocks),
    Q/K rows back in HF (rotate-half) order."""
    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    permuted = arch == "llama"  # llama.cpp interleaves Q/K rows only for its "llama" rope layout

    def w(name: str) -> torch.Tensor | BlockWeight:
        t = tensors[name]
        fmt = KEPT_BLOCKS.get(t.tensor_type.name) if keep_blocks and len(t.shape) == 2 else None
        if fmt is None:
            return _dequantize(t)
        try:
            return BlockWeight(fmt, torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(int(t.shape[1]), -1)))
        except ValueError as e:  # (rows that are not whole blocks: in_features not a multiple of the block)
            raise ValueError(f"tensor {name} ({t.tensor_type.name}, {int(t.shape[1])} x {int(t.shape[0])}): {e}") from e

    def cat(parts: list) -> torch.Tensor | BlockWeight:
        """Rows of several tensors: blocks stay blocks when all share one format, else all become fp32 (a Q4_K_M
        file's Q6_K attn_v beside Q4_K q and k: that layer's fused qkv)."""
        if all(isinstance(p, BlockWeight) for p in parts) and len({p.fmt for p in parts}) == 1:
            return BlockWeight.cat(parts)
        return torch.cat([dequantize(p) if isinstance(p, BlockWeight) else p for p in parts])

    out = {"embed": w("token_embd.weight"), "norm": w("output_norm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head"] = w("output.weight")
    for i in range(config.num_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        q, k, v = w(b + "attn_q.weight"), w(b + "attn_k.weight"), w(b + "attn_v.weight")
        if permuted:
            q, k = unpermute_rows(q, config.num_heads), unpermute_rows(k, config.num_kv_heads)
        out[p + "qkv"] = cat([q, k, v])  # [q + 2 kv, hidden]
        if config.attention_bias:
            qb, kb, vb = w(b + "attn_q.bias"), w(b + "attn_k.bias"), w(b + "attn_v.bias")
            if permuted:
                qb, kb = unpermute_rows(qb, config.num_heads), unpermute_rows(kb, config.num_kv_heads)
            out[p + "qkv_bias"] = torch.cat([qb, kb, vb])
        out[p + "input_norm"] = w(b + "attn_norm.weight")
        out[p + "o"] = w(b + "attn_output.weight")
        out[p + "post_norm"] = w(b + "ffn_norm.weight")
        # gate_up: [2 * intermediate, hidden]
        out[p + "gate_up"] = cat([w(b + "ffn_gate.weight"), w(b + "ffn_up.weight")])
        out[p + "down"] = w(b + "ffn_down.weight")
    return out


def unpermute_rows(w: torch.Tensor | BlockWeight, n_heads: int) -> torch.Tensor | BlockWeight:
    """GGUF stores each head's rows as interleaved pairs (x0, x_half, x1, x_half+1, ...);
    put them back as [first half; second half] per head, the layout rotate-half RoPE expects."""
    if isinstance(w, BlockWeight):  # (a row's blocks move with it)
        return BlockWeight(w.fmt, unpermute_rows(w.data, n_heads))
    rows = w.shape[0]
    head_dim = rows // n_heads
    # w: [n_heads * head_dim, ...] -> [n_heads, head_dim/2, 2, ...] -> [n_heads, 2, head_dim/2, ...]
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _dequantize(t) -> torch.Tensor:
    from gguf.quants import dequantize

    arr = dequantize(t.data, t.tensor_type)
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
    if arr.dtype != np.float32 or not arr.flags.writeable:  # F32 tensors come back as read-only memmaps
        arr = np.array(arr, dtype=np.float32)
    return torch.from_numpy(arr.reshape(shape))


def _cache_file(path: Path, cache_dir: Path, keep_blocks: bool) -> Path:
    st = path.stat()
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.name)
    mode = "-blocks" if keep_blocks else ""
    return cache_dir / "gguf" / f"{stem}-{st.st_size}-{st.st_mtime_ns}-v{CACHE_VERSION}{mode}.safetensors"


def _read_cache(cache: Path) -> tuple[LlamaConfig, dict, Tokenizer] | None:
    if not cache.is_file():
        return None
    try:
        with safe_open(str(cache), framework="pt") as f:
            meta = f.metadata()
        config = LlamaConfig(**json.loads(meta["config"]))
        tokenizer = Tokenizer.from_json(meta["tokenizer"])
        weights = load_file(str(cache))  # load_file maps the file, no copy
        for name, fmt in json.loads(meta.get("blocks", "{}")).items():
            weights[name] = BlockWeight(fmt, weights[name])
        return config, weights, tokenizer
    except Exception as e:  # an unreadable cache is only a miss; it gets rewritten
        log.warning("ignoring unreadable model cache %s: %s", cache, e)
        return None


def _write_cache(cache: Path, config: LlamaConfig, weights: dict, tokenizer: Tokenizer) -> None:
    """Temp file + rename, so a concurrent or interrupted load never sees half a file."""
    blocks = {name: w.fmt for name, w in weights.items() if isinstance(w, BlockWeight)}
    meta = {"config": json.dumps(dataclasses.asdict(config)), "tokenizer": tokenizer.to_json(),
            "blocks": json.dumps(blocks)}
    weights = {name: w.data if isinstance(w, BlockWeight) else w for name, w in weights.items()}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f".{cache.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as e:
        log.warning("not caching dequantized weights in %s: %s", cache.parent, e)
        return
    try:
        save_file(weights, tmp, metadata=meta)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared cache dir should stay readable
        os.replace(tmp, cache)
    except OSError as e:
        log.warning("not caching dequantized weights in %s: %s", cache.parent, e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
