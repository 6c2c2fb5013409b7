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
from loraplex.engine.quant import BLOCK_BYTES, BlockWeight, dequantize

pytestmark = pytest.mark.cpu_kernels

ROWS = (1, 3, 8, 33, 70)
SHAPES = [(7, 32), (51, 64), (130, 576)]  # [out, in]: odd and even outputs, one group to many


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


def block_parts(w: BlockWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(integers q~ int64 [N, G, 32], d fp32 [N, G], m fp32 [N, G] or None) of Q8_0 / Q4_0 / Q4_1 blocks."""
    n = w.shape[0]
    raw = w.data.numpy().reshape(n, -1, BLOCK_BYTES[w.fmt])
    half = lambda at: raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if w.fmt == "q8_0":
        return raw[..., 2:34].view(np.int8).astype(np.int64), half(0), None
    qs = raw[..., 2:18] if w.fmt == "q4_0" else raw[..., 4:20]
    q = np.concatenate((qs & 15, qs >> 4), axis=-1).astype(np.int64)  # weights 0..15 low nibbles, 16..31 high
    return (q - 8, half(0), None) if w.fmt == "q4_0" else (q, half(0), half(2))


def reference(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """The Semantics in numpy fp32, op by op."""
    a, sa, total = quantize_rows(x.numpy())
    q, d, mins = block_parts(w)
    s = np.einsum("mgk,ngk->mng", a, q).astype(np.float32)  # exact integers, exactly fp32 (< 2^24)
    t = d[None] * s
    if mins is not None:
        t = t + mins[None] * total[:, None, :].astype(np.float32)
    acc = np.zeros(t.shape[:2], dtype=np.float32)
    with np.errstate(all="ignore"):
        for g in range(t.shape[2]):
            acc = acc + sa[:, None, g] * t[:, :, g]
    return torch.from_numpy(acc)


def a8_linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return packed_linear(x, pack_blocks(w, act8=True), bias)


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
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_the_gemm_equals_the_reference_bit_for_bit(fmt, rows, shape):
    n, k = SHAPES[shape]
    w = random_blocks(fmt, n, k, seed=n)
    x = activations(rows, k, seed=rows)
    assert torch.equal(a8_linear(x, w), reference(x, w))
    bias = torch.randn(n)
    assert torch.equal(a8_linear(x, w, bias), reference(x, w) + bias)


@pytest.mark.parametrize("fmt", ACT8_KINDS)
def test_a_rows_result_does_not_depend_on_its_batch(fmt):
    w = random_blocks(fmt, 130, 576, seed=3)
    x = activations(70, 576, seed=4)
    whole = a8_linear(x, w)
    for lo, hi in ((0, 1), (5, 8), (8, 41), (3, 70), (69, 70)):
        assert torch.equal(a8_linear(x[lo:hi], w), whole[lo:hi])
    strided = torch.zeros(70, 600)
    strided[:, :576] = x  # rows with a stride wider than K
    assert torch.equal(a8_linear(strided[:, :576], w), whole)


@pytest.mark.parametrize("fmt", ACT8_KINDS)
def test_within_int8_rounding_of_the_fp32_gemm_over_the_dequantized_weights(fmt):
    """|y - y_fp32| <= sum over groups of sa / 2 * sum |w| (each a is x / sa rounded to nearest), plus fp32 slack."""
    n, k = 130, 576
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


def test_formats_without_an_int8_kernel_are_refused():
    with pytest.raises(ValueError, match="no int8-activation kernel takes q4_k blocks"):
        pack_blocks(random_blocks("q4_k", 7, 256), act8=True)
    with pytest.raises(ValueError, match="no int8-activation kernel takes f32 weights"):
        with_act8(pack(torch.zeros(7, 32)))
    p = pack_blocks(random_blocks("q8_0", 7, 64))
    assert with_act8(p).act8 and with_act8(p).data is p.data and not p.act8
