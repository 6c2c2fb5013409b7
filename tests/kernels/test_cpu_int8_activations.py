"""GEMMs over GGUF blocks with int8 activations (linear_act8.h, EngineConfig.activation_dtype int8): every build
(AVX-512 VNNI, AVX-512BW, AVX2, the portable loops) must equal the reference below bit for bit, which follows
the Semantics' written order in numpy fp32; a row's result must not depend on its batch; and the result must
lie within the int8 activations' rounding of the fp32 GEMM over the dequantized weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.cli.bench.blocks import random_blocks
from loraplex.engine.kernels.cpu import linear
from loraplex.engine.kernels.cpu.linear import ACT8_KINDS, pack, pack_blocks, packed_linear, with_act8
from loraplex.engine.quant import BLOCK_BYTES, BLOCK_WEIGHTS, BlockWeight, dequantize
from tests.unit.test_engine_lora import adapter_dirs  # noqa: F401 (a fixture)

pytestmark = pytest.mark.cpu_kernels

ROWS = (1, 3, 8, 33, 70)
# [out, in] per block size: odd and even outputs, one block to many
SHAPES = {32: [(7, 32), (51, 64), (130, 576)], 256: [(7, 256), (51, 512), (130, 768)]}


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] fp32 -> (a int64 [M, G, 32], sa fp32 [M, G], A int64 [M, G]) as the Semantics quantize."""
    m, k = x.shape
    xg = x.reshape(m, k // 32, 32)
    with np.errstate(all="ignore"):
        amax = np.abs(xg).max(-1)
        finite = np.isfinite(xg).all(-1)
        zero = finite & (amax < np.float32(2.0**-100))
        inv = np.float32(127) / amax
        a = np.clip(np.rint(xg * inv[..., None]), -127, 127)
        sa = amax / np.float32(127)
    a[~finite | zero] = 0
    sa[zero], sa[~finite] = 0, np.nan
    a = a.astype(np.int64)
    return a, sa.astype(np.float32), a.sum(-1)


def _field(raw: np.ndarray, byte: np.ndarray, shift: np.ndarray, bits: int) -> np.ndarray:
    """Bits `bits` at `shift` of byte `byte` [256] of each block of raw [N, blocks, bytes] -> int64 [N, blocks, 256]."""
    return (raw[..., byte].astype(np.int64) >> shift) & ((1 << bits) - 1)


def _kquant_ints(raw: np.ndarray, fmt: str) -> np.ndarray:
    """The integers of K-quant blocks (gguf's bit places, as quant_blocks.h's q_block_field lists them)."""
    i = np.arange(256)
    if fmt == "q6_k":
        low = _field(raw, 64 * (i // 128) + i % 64, 4 * (i % 128 // 64), 4)
        return low | _field(raw, 128 + 32 * (i // 128) + i % 32, 2 * (i % 128 // 32), 2) << 4
    at = 16 if fmt == "q4_k" else 48
    low = _field(raw, at + 32 * (i // 64) + i % 32, np.where(i % 64 < 32, 0, 4), 4)
    return low if fmt == "q4_k" else low | _field(raw, 16 + i % 32, i // 32, 1) << 4


def _kquant_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 6-bit sub-block scales and mins [N, blocks, 8] (gguf's get_scale_min)."""
    b = raw[..., 4:16].astype(np.int64)
    sc = np.concatenate((b[..., 0:4] & 63, (b[..., 8:12] & 15) | (b[..., 0:4] >> 6) << 4), axis=-1)
    mn = np.concatenate((b[..., 4:8] & 63, (b[..., 8:12] >> 4) | (b[..., 4:8] >> 6) << 4), axis=-1)
    return sc, mn


def block_parts(w: BlockWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """(integers q~ int64 [N, K / 32, 32] less the format's offset, scales d fp32 [N, K / 32, subs], mins m fp32
    [N, K / 32] or None, subs: sub-blocks per 32 k), d and m as the fp32 products the Semantics name."""
    n = w.shape[0]
    raw = w.data.numpy().reshape(n, -1, BLOCK_BYTES[w.fmt])
    half = lambda at: raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if w.fmt == "q8_0":
        return raw[..., 2:34].view(np.int8).astype(np.int64), half(0)[..., None], None, 1
    if w.fmt in ("q4_0", "q4_1"):
        qs = raw[..., 2:18] if w.fmt == "q4_0" else raw[..., 4:20]
        q = np.concatenate((qs & 15, qs >> 4), axis=-1).astype(np.int64)  # weights 0..15 low nibbles, 16..31 high
        return (q - 8, half(0)[..., None], None, 1) if w.fmt == "q4_0" else (q, half(0)[..., None], half(2), 1)
    q = _kquant_ints(raw, w.fmt).reshape(n, -1, 32)
    if w.fmt == "q6_k":
        d = half(208)[..., None] * raw[..., 192:208].view(np.int8).astype(np.float32)  # [N, blocks, 16]
        return q - 32, d.reshape(n, -1, 2), None, 2
    sc, mn = _kquant_scales(raw)
    d = half(0)[..., None] * sc.astype(np.float32)
    m = half(2)[..., None] * mn.astype(np.float32)
    return q, d.reshape(n, -1, 1), m.reshape(n, -1), 1


def reference(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """The Semantics in numpy fp32, op by op."""
    a, sa, _ = quantize_rows(x.numpy())
    q, d, mins, subs = block_parts(w)
    a_sub, q_sub = a.reshape(*a.shape[:2], subs, -1), q.reshape(*q.shape[:2], subs, -1)
    s = np.einsum("mghk,nghk->mngh", a_sub, q_sub).astype(np.float32)  # exact integers, exactly fp32 (< 2^24)
    t = d[None] * s
    if mins is not None:
        mt = mins[None, :, :, None] * a_sub.sum(-1).astype(np.float32)[:, None]  # m * (float)A
        t = t + mt if w.fmt == "q4_1" else t - mt
    acc = np.zeros(t.shape[:2], dtype=np.float32)
    with np.errstate(all="ignore"):
        for g in range(t.shape[2]):
            for h in range(subs):
                acc = acc + sa[:, None, g] * t[:, :, g, h]
    return torch.from_numpy(acc)


def a8_linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return packed_linear(x, with_act8(pack_blocks(w)), bias)


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 3
    x[:, ::7] *= 20  # an outlier every 7th feature, as a model's activations have
    return x


@pytest.fixture(autouse=True)
def _packed_kernel_for_every_batch(monkeypatch):
    monkeypatch.setattr(linear, "PACKED_MAX_ROWS", 10**6)  # fp32 references through the packed kernel, not MKL


@pytest.mark.parametrize("fmt", ACT8_KINDS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", range(3))
def test_the_gemm_equals_the_reference_bit_for_bit(fmt, rows, shape):
    n, k = SHAPES[BLOCK_WEIGHTS[fmt]][shape]
    w = random_blocks(fmt, n, k, seed=n)
    x = activations(rows, k, seed=rows)
    assert torch.equal(a8_linear(x, w), reference(x, w))
    bias = torch.randn(n)
    assert torch.equal(a8_linear(x, w, bias), reference(x, w) + bias)


@pytest.mark.parametrize("fmt", ACT8_KINDS)
def test_a_rows_result_does_not_depend_on_its_batch(fmt):
    k = 768
    w = random_blocks(fmt, 130, k, seed=3)
    x = activations(70, k, seed=4)
    whole = a8_linear(x, w)
    for lo, hi in ((0, 1), (5, 8), (8, 41), (3, 70), (69, 70)):
        assert torch.equal(a8_linear(x[lo:hi], w), whole[lo:hi])
    strided = torch.zeros(70, k + 40)
    strided[:, :k] = x  # rows with a stride wider than K
    assert torch.equal(a8_linear(strided[:, :k], w), whole)


@pytest.mark.parametrize("fmt", ACT8_KINDS)
def test_within_int8_rounding_of_the_fp32_gemm_over_the_dequantized_weights(fmt):
    """|y - y_fp32| <= sum over groups of sa / 2 * sum |w| (each a is x / sa rounded to nearest), plus fp32 slack."""
    n, k = 130, 768
    w = random_blocks(fmt, n, k, seed=5)
    x = activations(33, k, seed=6)
    values = dequantize(w)
    want = packed_linear(x, pack(values))
    _, sa, _ = quantize_rows(x.numpy())
    group_abs = values.abs().reshape(n, k // 32, 32).sum(-1)  # [N, G]
    bound = torch.from_numpy(sa / 2) @ group_abs.T * 1.001 + 1e-5 * (x.abs() @ values.abs().T)
    err = (a8_linear(x, w) - want).abs()
    assert (err <= bound).all()
    assert err.max() > 0  # (the activations are rounded: not the fp32 result)


def test_hostile_rows():
    """Zero rows give zeros (the bias); huge values stay finite and exact; a group with a NaN or an infinity makes
    its row NaN, and only its row; values below 2^-100 quantize to zero."""
    w = random_blocks("q4_1", 51, 64, seed=1)
    x = activations(6, 64, seed=2)
    x[0] = 0
    x[1] *= 1e30
    x[2, 40] = float("nan")
    x[3, 3] = float("inf")
    x[4] = 1e-35
    bias = torch.randn(51)
    y = a8_linear(x, w, bias)
    assert torch.equal(y[0], bias) and torch.equal(y[4], bias)
    assert torch.isfinite(y[1]).all() and torch.equal(y[1], (reference(x[1:2], w) + bias)[0])
    assert torch.isnan(y[2]).all() and torch.isnan(y[3]).all()
    assert torch.equal(y[5], a8_linear(x[5:6], w, bias)[0])
    assert torch.allclose(y, reference(x, w) + bias, rtol=0, atol=0, equal_nan=True)


def test_float_panels_are_refused():
    with pytest.raises(ValueError, match="no int8-activation kernel takes f32 weights"):
        with_act8(pack(torch.zeros(7, 32)))
    p = pack_blocks(random_blocks("q8_0", 7, 64))
    assert with_act8(p).act8 and with_act8(p).data is p.data and not p.act8


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q4_k", "q6_k"])
def test_the_fused_decode_step_takes_the_same_int8_gemms_as_the_per_op_path(fmt, monkeypatch):
    """A model packed with act8: the fused decode step equals the per-op path bit for bit (its model table carries
    each weight's act8 flag), its logits lie near the float-activation model's, and are not the same."""
    from loraplex.engine.models.llama import LlamaModel
    from tests.kernels.test_cpu_decode_step import PROMPTS, _both_paths, _model_and_cache, _prefill
    from tests.kernels.test_cpu_quant_weights import _preset

    model, storage = _model_and_cache(_preset(fmt), blocks=fmt)  # (float activations: the comparison)
    act8 = LlamaModel(model.config, model.w, act8=True)  # (the same panels)
    assert act8.layers[0].qkv.act8 and act8.lm_head_w.act8 and not model.layers[0].qkv.act8
    assert act8.layers[0].qkv.kind == fmt and act8.layers[0].qkv.data is model.layers[0].qkv.data
    ids = torch.randint(0, model.config.vocab_size, (len(PROMPTS),), generator=torch.Generator().manual_seed(1))
    rows = torch.arange(len(PROMPTS))
    logits = {}
    for name, m in (("act8", act8), ("float", model)):
        _prefill(m, storage, torch.Generator().manual_seed(0))
        logits[name] = _both_paths(m, storage, ids, rows, monkeypatch)
    rel = (logits["act8"] - logits["float"]).norm() / logits["float"].norm()
    print(fmt, float(rel))
    assert rel < 0.1  # (random weights, random Q6_K ones the largest: the error grows through the layers)
    assert not torch.equal(logits["act8"], logits["float"])


def _engine_config(**overrides):
    from loraplex.engine.config import EngineConfig
    from tests.unit.test_engine_core import MODEL

    params = {"model": MODEL, "device": "cpu", "dtype": "float32", "num_kv_blocks": 256, "weight_dtype": "int4",
              "lora_merge_after_steps": 0, "max_num_batched_tokens": 64}
    return EngineConfig(**(params | overrides))


def test_an_engine_with_int8_activations_decodes_near_its_float_activations(adapter_dirs):  # noqa: F811
    """Q4_1 projections, adapters folded and not, chunked prefills and fused decode steps: the same greedy
    requests with activation_dtype int8 and float32 give tokens whose log-probabilities agree closely."""
    from loraplex.engine.core import EngineCore
    from tests.unit.test_bf16_weights import run_mixed_adapters

    engines = {a: EngineCore(_engine_config(activation_dtype=a)) for a in ("int8", "float32")}
    assert engines["int8"].runner.model.layers[0].down.act8 and not engines["float32"].runner.model.layers[0].down.act8
    outputs = run_mixed_adapters(engines, adapter_dirs, ["a0", None, "a1", "a3", None, "a0"], 3, 8)
    for rid, want in outputs["float32"].items():
        got = outputs["int8"][rid]
        assert len(got) == len(want) == 8
        assert got[0][0] == want[0][0] and abs(got[0][1] - want[0][1]) < 0.05, rid  # the prefill's token
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a[0] != b[0]), len(got))
        assert all(abs(got[i][1] - want[i][1]) < 0.05 for i in range(same)), rid  # until the tokens part


def test_int8_activations_are_refused_where_nothing_would_take_them():
    from loraplex.engine.core import EngineCore

    with pytest.raises(ValueError, match="activation_dtype must be one of float32, int8, got 'int4'"):
        _engine_config(activation_dtype="int4")
    with pytest.raises(ValueError, match="activation_dtype int8 runs on the CPU over GGUF blocks .* weight_dtype "
                                         "bfloat16"):
        _engine_config(activation_dtype="int8", weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="activation_dtype int8: no projection of synthetic:tiny is in GGUF blocks "
                                         "\\(they are f32\\)"):
        EngineCore(_engine_config(activation_dtype="int8", weight_dtype="auto"))


@pytest.mark.parametrize("fmt", ["q4_1", "q6_k"])
def test_a_folded_adapter_adds_its_fp32_delta_to_the_int8_gemm(fmt):
    """lp_linear_fold_a8_*: the kept rows get the int8 GEMM plus the adapter's delta over fp32 x (to fp32
    rounding), the others exactly the int8 GEMM."""
    from tests.kernels.test_cpu_lora_fold import fold_block

    n, k = SHAPES[BLOCK_WEIGHTS[fmt]][2]
    widths, rank = (n - 40, 40), 8
    g = torch.Generator().manual_seed(7)
    w = random_blocks(fmt, n, k, seed=8)
    x = activations(33, k, seed=9)
    a = torch.randn(2 * rank, k, generator=g) * 0.05
    b = torch.randn(n, rank, generator=g) * 0.05
    keep = (torch.rand(33, generator=g) < 0.6).to(torch.uint8)
    keep[0], keep[-1] = 1, 0
    got = linear.packed_linear_fold(x, with_act8(pack_blocks(w)), fold_block(a, b, widths, rank), widths, rank, keep)
    plain = a8_linear(x, w)
    assert torch.equal(got[keep == 0], plain[keep == 0])
    delta = torch.cat([x @ a[s * rank:(s + 1) * rank].T @ b[off:off + wd].T
                       for s, (off, wd) in enumerate(((0, widths[0]), (widths[0], widths[1])))], dim=1)
    torch.testing.assert_close(got[keep == 1], (plain + delta)[keep == 1], rtol=1e-4, atol=1e-4)


def test_the_serve_flag_reaches_the_engine_and_a_refusal_names_the_setting():
    from tests.unit.test_memory_sizing import _args, build_engine

    engine = build_engine(_args("--model", "synthetic:tiny", "--device", "cpu", "--weight-dtype", "int4",
                                "--activation-dtype", "int8", "--kv-cache-mb", "16"))
    try:
        assert engine.core.config.activation_dtype == "int8" and engine.core.runner.model.layers[0].qkv.act8
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="^activation_dtype int8: no projection of synthetic:tiny is in GGUF blocks"):
        build_engine(_args("--model", "synthetic:tiny", "--device", "cpu", "--activation-dtype", "int8",
                           "--kv-cache-mb", "16"))
