"""GGUF block weights (engine/quant.py) and linear.c's quantized builds (quant_blocks.h): Q8_0, Q4_0, Q4_1 and the
K-quants Q4_K, Q5_K, Q6_K (256-weight blocks).

Dequantization must equal gguf's own, bit for bit; a GEMM over packed blocks must equal the fp32 GEMM over
the dequantized weights bit for bit (the kernel dequantizes in registers and sums in the fp32 build's
order), with and without a folded adapter, at every row count the kernel groups differently; but one row of
4-bit weights, which linear.c sums per group (ROW_SUMS), agrees to fp32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.cli.bench.blocks import random_blocks
from loraplex.engine.kernels.cpu import linear
from loraplex.engine.kernels.cpu.linear import PanelBlocks, pack, pack_blocks, packed_linear, packed_linear_fold
from loraplex.engine.quant import BLOCK_BYTES, BLOCK_WEIGHTS, BlockWeight, dequantize, quantize

pytestmark = pytest.mark.cpu_kernels

FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")
K_QUANTS = ("q4_k", "q5_k", "q6_k")
# GEMM shapes [out, in] per block size: odd and even outputs, one block to many
SHAPES = {32: [(7, 32), (50, 64), (96, 576), (130, 1536)], 256: [(7, 256), (51, 512), (96, 768), (130, 1536)]}
def random_kquant_weights(weights: dict, fmt: str) -> dict:
    """A float model's projections as random `fmt` blocks of their shapes (no quantizer here makes K-quants),
    its LM head (or the tied embedding) as Q6_K, as a Q4_K_M file holds it."""
    out = dict(weights)
    for i, (name, w) in enumerate(sorted(weights.items())):
        if name.rsplit(".", 1)[-1] in ("qkv", "o", "gate_up", "down"):
            out[name] = random_blocks(fmt, *w.shape, seed=i)
    head = "lm_head" if "lm_head" in weights else "embed"
    out[head] = random_blocks("q6_k", *weights[head].shape, seed=99)
    return out


@pytest.fixture(autouse=True)
def _packed_kernel_for_every_batch(monkeypatch):
    monkeypatch.setattr(linear, "PACKED_MAX_ROWS", 10**6)  # fp32 references through the packed kernel, not MKL


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_the_gguf_package(fmt):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    k = 5 * BLOCK_WEIGHTS[fmt]
    w = random_blocks(fmt, 9, k)
    want = gguf_dequantize(w.data.numpy(), GGMLQuantizationType[fmt.upper()])
    assert torch.equal(dequantize(w), torch.from_numpy(np.asarray(want, dtype=np.float32)).reshape(9, k))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", range(4))
def test_a_gemm_over_blocks_equals_the_fp32_gemm_over_their_values(fmt, shape):
    n, k = SHAPES[BLOCK_WEIGHTS[fmt]][shape]
    w = random_blocks(fmt, n, k, seed=n)
    blocks, floats = pack_blocks(w), pack(dequantize(w))
    assert blocks.kind == fmt and blocks.weight is None
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g)
    for m in (1, 2, 3, 8, 9, 33, 70):  # one row, one group, several groups, a second 64-row block
        x = torch.randn(m, k, generator=g)
        got, want = packed_linear(x, blocks, bias), packed_linear(x, floats, bias)
        if m == 1 and fmt != "q8_0":  # (group sums: as close to the exact product as the fp32 GEMM is)
            exact = x.double() @ dequantize(w).double().T + bias.double()
            bound = 2 * float((want.double() - exact).abs().max()) + 1e-6 * float(exact.abs().max())
            assert float((got.double() - exact).abs().max()) <= bound, (fmt, shape)
            continue
        assert torch.equal(got, want), (fmt, shape, m)
        assert torch.equal(packed_linear(x, blocks), packed_linear(x, floats))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_folded_adapter_over_blocks_equals_the_fold_over_fp32(fmt):
    """The fold block's layout does not depend on the weights' type: one block serves both GEMMs."""
    widths, rank, k = (64, 32, 32), 8, 2 * BLOCK_WEIGHTS[fmt]
    w = random_blocks(fmt, sum(widths), k, seed=3)
    block = torch.randn(linear.fold_module_floats(k, widths, rank), generator=torch.Generator().manual_seed(4))
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(5))
    keep = torch.tensor([1, 0] * 5 + [1], dtype=torch.uint8)
    got = packed_linear_fold(x, pack_blocks(w), block, widths, rank, keep)
    assert torch.equal(got, packed_linear_fold(x, pack(dequantize(w)), block, widths, rank, keep))
    assert not torch.equal(got, packed_linear(x, pack_blocks(w)))  # (the delta is there)


@pytest.mark.parametrize("fmt, bound", [("q8_0", 1 / 254), ("q4_1", 1 / 30)])
def test_quantize_rounds_each_weight_to_its_block_grid(fmt, bound):
    """Q8_0 errs by at most half a step of max|w| / 127 per block, Q4_1 by half of (max - min) / 15 (plus the
    fp16 rounding of the scales)."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(6))
    q = quantize(w, fmt)
    assert q.fmt == fmt and tuple(q.shape) == (40, 96) and q.nbytes == 40 * 3 * BLOCK_BYTES[fmt]
    blocks = w.reshape(40, 3, 32)
    span = blocks.abs().amax(-1) * 2 if fmt == "q8_0" else blocks.amax(-1) - blocks.amin(-1)
    err = (dequantize(q) - w).reshape(40, 3, 32).abs().amax(-1)
    assert bool((err <= span * bound * 1.01 + 1e-6).all())
    zero = quantize(torch.zeros(2, 32), fmt)  # an all-zero block has scale 0, not a division by zero
    assert torch.equal(dequantize(zero), torch.zeros(2, 32))


def test_refusals_name_the_format_and_the_shape():
    with pytest.raises(ValueError, match="in a multiple of 32, got \\(4, 40\\)"):
        quantize(torch.zeros(4, 40), "q8_0")
    with pytest.raises(ValueError, match="makes q8_0 or q4_1 blocks, not 'q4_0'"):
        quantize(torch.zeros(4, 32), "q4_0")
    with pytest.raises(ValueError, match="block format 'q3_k' is not one of q8_0, q4_0, q4_1, q4_k, q5_k, q6_k"):
        BlockWeight("q3_k", torch.zeros(1, 110, dtype=torch.uint8))
    with pytest.raises(ValueError, match="q4_1 blocks must be uint8 \\[rows, blocks \\* 20\\], got torch.uint8 "):
        BlockWeight("q4_1", torch.zeros(2, 30, dtype=torch.uint8))
    with pytest.raises(ValueError, match="q6_k blocks must be uint8 \\[rows, blocks \\* 210\\]"):
        BlockWeight("q6_k", torch.zeros(2, 144, dtype=torch.uint8))
    with pytest.raises(ValueError, match="quantize makes q8_0 or q4_1 blocks, not 'q4_k'"):
        quantize(torch.zeros(4, 256), "q4_k")


def _preset(fmt: str) -> str:
    return "tiny-wide" if fmt in K_QUANTS else "tiny"  # (K-quants: every in_features a multiple of 256)


def _fp32_model(model):
    from loraplex.engine.models.llama import LlamaModel

    return LlamaModel(model.config, {k: dequantize(v) if isinstance(v, BlockWeight) else v for k, v in model.w.items()})


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q4_k", "q5_k", "q6_k"])
def test_a_block_models_fused_decode_step_matches_its_per_op_path_and_the_fp32_step(fmt, monkeypatch):
    from tests.kernels.test_cpu_decode_step import PROMPTS, _both_paths, _decode, _model_and_cache, _prefill

    g = torch.Generator().manual_seed(0)
    model, storage = _model_and_cache(_preset(fmt), blocks=fmt)
    assert model.layers[0].qkv.kind == fmt and model.lm_head_w.kind == ("q6_k" if fmt in K_QUANTS else "q8_0")
    _prefill(model, storage, g)
    ids = torch.randint(0, model.config.vocab_size, (len(PROMPTS),), generator=g)
    rows = torch.arange(len(PROMPTS))
    got = _both_paths(model, storage, ids, rows, monkeypatch)
    fp32 = _fp32_model(model)
    assert fp32.layers[0].qkv.kind == "f32"
    assert torch.equal(got, _decode(fp32, storage, ids, rows, None, True, monkeypatch))


@pytest.mark.parametrize("fmt", ["q4_1", "q4_k"])
def test_a_block_models_fold_and_lora_step_equals_the_fp32_step_over_its_values(fmt, tmp_path, monkeypatch):
    """12 rows: adapter a folded into the GEMMs (lp_linear_fold_<fmt>), b served by lora.c, two base rows."""
    from tests.kernels.test_cpu_decode_step import _decode, _fold_setup

    model, storage, slots, lora, token_slots, ids, prompts = _fold_setup(tmp_path, blocks=fmt, preset=_preset(fmt))
    assert lora.kernel_args()[2] is not None and model.layers[0].o.kind == fmt  # a fold
    rows, before = torch.arange(len(prompts)), storage.clone()
    got = _decode(model, storage, ids, rows, lora, True, monkeypatch, prompts)
    storage.copy_(before)
    assert torch.equal(got, _decode(_fp32_model(model), storage, ids, rows, lora, True, monkeypatch, prompts))


@pytest.mark.parametrize("fmt", FORMATS)
def test_panels_give_back_their_blocks_and_rows(fmt):
    """PanelBlocks (a resident model's only copy of a block weight): the GGUF rows unpacked from the panels
    are the ones packed, and rows taken from the panels equal those rows dequantized."""
    for n, k in SHAPES[BLOCK_WEIGHTS[fmt]][:3]:
        w = random_blocks(fmt, n, k, seed=n + 7)
        panels = PanelBlocks(pack_blocks(w))
        assert torch.equal(panels.data, w.data) and panels.shape == w.shape and panels.fmt == fmt
        index = torch.tensor([0, n - 1, n // 2, n // 2, 5 % n])
        assert torch.equal(panels.rows(index), dequantize(w)[index])
        assert pack_blocks(panels).kind == fmt  # (packing its rows again: the same panels)
        assert torch.equal(pack_blocks(panels).data, panels.packed.data)
