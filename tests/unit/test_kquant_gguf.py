"""A GGUF of K-quant matrices (Q4_K, Q5_K and Q6_K side by side, as a Q4_K_M file mixes them) loaded end to end:
under --weight-dtype auto the CPU engine serves them in their blocks (linear.c's K-quant builds) and gives the
greedy tokens of the same file dequantized to fp32, at a fraction of the resident bytes."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from gguf import GGMLQuantizationType

from loraplex.cli.bench.blocks import random_blocks
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.models.loader import load_model, resolve_model
from tests.unit.test_bf16_weights import run_with_logprobs
from tests.unit.test_loader import write_tiny_gguf
from tests.unit.test_quant_weights import assert_same_tokens

pytestmark = pytest.mark.cpu_kernels

# Each matrix's type by its GGUF name (a Q4_K_M file's choice for some layers: V and down at 6 bits)
STORED = {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q5_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K"}


def _kquant(name: str, w: torch.Tensor):
    """Random blocks of the matrix's STORED type and shape (blk.0.attn_q.weight -> attn_q)."""
    kind = STORED[name.split(".")[-2]]
    return random_blocks(kind.lower(), *w.shape, seed=zlib.crc32(name.encode())).data, GGMLQuantizationType[kind]


def test_a_kquant_gguf_is_served_in_its_blocks_with_the_tokens_of_its_fp32_values(tmp_path, monkeypatch):
    path = tmp_path / "kquants.gguf"
    write_tiny_gguf(path, preset="tiny-wide", matrix=_kquant)  # (every in_features a multiple of 256)
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    src = resolve_model(str(path))
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64)
    blocks, fp32 = load_model(src, quant=cfg.weight_quant), load_model(src)
    w = blocks.weights
    assert (w["embed"].fmt, w["lm_head"].fmt) == ("q4_k", "q6_k")
    assert [w[f"layers.1.{m}"].fmt for m in ("qkv", "o", "gate_up", "down")] == ["q4_k", "q5_k", "q4_k", "q6_k"]
    assert fp32.weights["layers.1.qkv"].dtype == torch.float32
    engines = {"blocks": EngineCore(cfg, loaded=blocks),
               "fp32": EngineCore(dataclasses.replace(cfg, weight_dtype="float32"), loaded=fp32)}
    model = engines["blocks"].runner.model
    assert [model.layers[0].o.kind, model.layers[0].down.kind, model.lm_head_w.kind] == ["q5_k", "q6_k", "q6_k"]
    assert engines["blocks"].weight_bytes * 5 < engines["fp32"].weight_bytes  # (4.6-6.6 bits a weight)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    lengths = (5, 17, 3, 30)  # decode batches of 4 rows, and of one once the shorter ones finish
    reqs = [GenerateRequest(f"r{i}", str(path), sampling=dataclasses.replace(sp, max_tokens=4 + 4 * (i == 3)),
                            prompt_token_ids=tuple(torch.randint(0, 256, (n,), generator=g).tolist()))
            for i, n in enumerate(lengths)]
    outputs = {name: run_with_logprobs(core, reqs) for name, core in engines.items()}
    # (a one-row step sums 4- to 6-bit weights per sub-block, linear.c's ROW_SUMS: the same tokens, close log-probs)
    assert_same_tokens(outputs["blocks"], outputs["fp32"], logprob_tolerance=1e-4)
