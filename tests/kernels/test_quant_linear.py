"""Quantized weight GEMMs on the test device against kernels/quant_ref.py: the W8A16 Triton kernel over ragged
token counts, shapes off the block sizes, dtypes, per-channel and per-group scales, split K and bias; the
quantization math (int8 and FP8 round trips, scales, saturation); FP8 through torch._scaled_mm where it runs
(CUDA sm89+; on the CPU the same call where this torch has it) and its refusal elsewhere; refusals naming the
tensor. On the CPU Triton runs in its interpreter (tests/conftest.py), so shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels import quant_linear
from loraplex.engine.kernels.fp8_linear import fp8_linear, fp8_unsupported, scaled_mm
from loraplex.engine.kernels.quant import (
    FP8_MAX,
    dequantize_fp8,
    dequantize_int8,
    quantize_fp8,
    quantize_int8,
)
from loraplex.engine.kernels.quant_ref import ref_fp8_linear, ref_w8a16_linear
from loraplex.engine.kernels.w8a16 import w8a16_linear
from tests.conftest import test_device

DEVICE = test_device()
# Outputs are O(1) (weights ~ N(0, 1/K)): the kernel differs from the fp32 reference by its summation order
# and one rounding to the output dtype.
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SHAPES = [(50, 150), (96, 80), (33, 200), (16, 272)]  # (N, K): K over and under the 128 block, N mostly ragged
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8_WHY_NOT = fp8_unsupported(DEVICE)


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5


def inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] in dtype and a bias [n] fp32, on the test device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(DEVICE, dtype), torch.randn(n, generator=g).to(DEVICE)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.device.type == DEVICE.type
    tol = TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_w8a16_matches_reference(m: int, dtype: torch.dtype) -> None:
    """Ragged token counts x every activation dtype, each over two weight shapes, with and without bias."""
    for i, (n, k) in enumerate(SHAPES[m % 2::2]):
        q, s = quantize_int8(weight(n, k, seed=m + i))
        x, bias = inputs(m, k, n, dtype, seed=i)
        q, s = q.to(DEVICE), s.to(DEVICE)
        with_bias = bias if (m + i) % 2 else None
        check(w8a16_linear(x, q, s, with_bias), ref_w8a16_linear(x, q, s, with_bias), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size,split_k", [(32, 1), (128, 2), (16, 3)])
def test_w8a16_group_scales_and_split_k(group_size: int, split_k: int, dtype: torch.dtype) -> None:
    """Per-group scales (K = 200: a partial last group) and the K reduction split over programs."""
    n, k, m = 40, 200, 5
    q, s = quantize_int8(weight(n, k, seed=group_size), group_size)
    assert s.shape == (n, -(-k // group_size))
    x, bias = inputs(m, k, n, dtype)
    q, s = q.to(DEVICE), s.to(DEVICE)
    got = w8a16_linear(x, q, s, bias, group_size=group_size, split_k=split_k, block_k=16)
    check(got, ref_w8a16_linear(x, q, s, bias, group_size), dtype)


def test_w8a16_explicit_blocks_and_empty_batch() -> None:
    n, k = 70, 130
    q, s = (t.to(DEVICE) for t in quantize_int8(weight(n, k)))
    x, bias = inputs(33, k, n, torch.float16)
    got = w8a16_linear(x, q, s, bias, block_m=16, block_n=16, block_k=64)
    check(got, ref_w8a16_linear(x, q, s, bias), torch.float16)
    assert w8a16_linear(x[:0], q, s).shape == (0, n)


@pytest.mark.parametrize("group_size", [None, 16, 64])
def test_int8_round_trip_error_is_half_a_step(group_size: int | None) -> None:
    """|w - q*s| <= s/2 everywhere; each row's (group's) largest |w| maps to +-127; a zero row stays zero."""
    w = weight(24, 100, seed=3) * torch.linspace(0.01, 10, 24)[:, None]  # rows of very different ranges
    w[5] = 0
    q, s = quantize_int8(w.bfloat16(), group_size)
    wb = w.bfloat16().float()
    step = s[:, None] if group_size is None else s.repeat_interleave(group_size, dim=1)[:, :100]
    err = (wb - dequantize_int8(q, s, group_size)).abs()
    assert bool((err <= step / 2 + 1e-6 * wb.abs()).all())
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(q[5], torch.zeros_like(q[5])) and bool((s[5] == 1).all())
    if group_size is None:  # every non-zero row reaches the end of the range
        assert torch.equal(q.abs().amax(dim=1)[torch.arange(24) != 5], torch.full((23,), 127, dtype=torch.int8))
    cols = wb.shape[1] if group_size is None else group_size
    amax = torch.nn.functional.pad(wb.abs(), (0, -100 % cols)).view(24, -1, cols).amax(dim=2).squeeze(1)
    torch.testing.assert_close(s, torch.where(amax > 0, amax / 127, torch.ones_like(amax)))


@pytest.mark.parametrize("per", ["row", "tensor"])
def test_fp8_scales_round_trip_and_saturation(per: str) -> None:
    """s = amax / 448 (per row or one for the tensor); the row (tensor) maximum lands on +-448 exactly;
    e4m3's 3 mantissa bits bound the relative error by 2^-4 (subnormals: half a 2^-9 step)."""
    w = weight(32, 64, seed=4) * torch.linspace(0.1, 5, 32)[:, None]
    q, s = quantize_fp8(w, per)
    amax = w.abs().amax(dim=1, keepdim=True)
    want = amax / FP8_MAX if per == "row" else (amax.max() / FP8_MAX).expand_as(amax)
    torch.testing.assert_close(s, want, rtol=0, atol=0)
    qf = q.float()
    assert q.dtype == torch.float8_e4m3fn and not bool(qf.isnan().any())
    if per == "row":
        assert torch.equal(qf.abs().amax(dim=1), torch.full((32,), FP8_MAX))
    assert float(qf.abs().max()) == FP8_MAX
    err = (w - dequantize_fp8(q, s)).abs()
    assert bool((err <= (2 ** -4 * w.abs() + 2 ** -10 * s) * 1.001).all())


def test_fp8_saturates_beyond_a_given_scale_and_never_gives_nan() -> None:
    """With a static scale, values beyond 448 * s clamp to +-448 (a bare cast gives NaN in some torch builds and
    kernels); with computed
    scales a token's outlier sets the tensor's scale and lands on 448 exactly."""
    x = torch.tensor([[0.96, -1.92, 0.48, 0.0], [1e4, -1e4, 2.88, 0.0]])
    q, s = quantize_fp8(x, scales=torch.tensor(0.01))
    assert torch.equal(q.float(), torch.tensor([[96.0, -192.0, 48.0, 0.0], [FP8_MAX, -FP8_MAX, 288.0, 0.0]]))
    assert torch.equal(s, torch.full((2, 1), 0.01))
    q, s = quantize_fp8(x, "tensor")
    assert torch.equal(q.float()[1, :2], torch.tensor([FP8_MAX, -FP8_MAX])) and torch.equal(s[0], s[1])
    assert float(s[0]) == pytest.approx(1e4 / FP8_MAX) and not bool(q.float().isnan().any())


@pytest.mark.parametrize("act_scale", ["token", "tensor"])
def test_fp8_scaled_mm_call_against_reference(act_scale: str) -> None:
    """The torch._scaled_mm call fp8_linear makes (operand layout, scale shapes), on the device where FP8 runs
    (through fp8_linear, bias and all), else on the CPU when this torch runs _scaled_mm there."""
    n, k = 48, 64
    wq, ws = quantize_fp8(weight(n, k, seed=5))
    x, bias = inputs(17, k, n, torch.bfloat16)
    want = ref_fp8_linear(x, wq, ws, bias, act_scale)
    if FP8_WHY_NOT is None:
        got = fp8_linear(x, wq.to(DEVICE), ws.to(DEVICE), bias, act_scale=act_scale)
        assert got.dtype == torch.bfloat16 and got.device == x.device
        torch.testing.assert_close(got.cpu().float(), want, atol=3e-2, rtol=2e-2)
        return
    xq, sx = quantize_fp8(x.cpu(), "row" if act_scale == "token" else "tensor")
    try:
        got = scaled_mm(xq, sx, wq, ws)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"FP8 does not run here ({FP8_WHY_NOT}) and torch {torch.__version__} has no CPU "
                    f"_scaled_mm: {e}")
    torch.testing.assert_close(got.float() + bias.cpu(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.skipif(FP8_WHY_NOT is None, reason="FP8 runs on this device")
def test_fp8_linear_refuses_where_it_cannot_run() -> None:
    qw = quant_linear.quantize(weight(32, 32), "fp8", name="layers.3.mlp.down")
    x, _ = inputs(2, 32, 32, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"layers\.3\.mlp\.down: cannot run an FP8 weight here: .*") as e:
        quant_linear.linear(x, qw.to(DEVICE))
    assert FP8_WHY_NOT in str(e.value)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_wrapper_quantize_and_linear(kind: str) -> None:
    """quantize once, linear over [batch, tokens, in] activations: the reference over the same values; bytes
    are the quantized values plus scales; dequantize gives the weight back within the format's error."""
    n, k = 48, 80
    w = weight(n, k, seed=6)
    qw = quant_linear.quantize(w, kind, group_size=16 if kind == "int8" else None, name="layers.0.qkv")
    assert qw.shape == (n, k) and qw.nbytes == n * k + qw.scales.numel() * 4
    assert float((qw.dequantize() - w).abs().max()) < (0.01 if kind == "int8" else 0.03)
    x, bias = inputs(6, k, n, torch.bfloat16)
    if kind == "fp8" and FP8_WHY_NOT is not None:  # (no FP8 GEMM here: the linear refuses, naming why)
        with pytest.raises(RuntimeError, match="layers.0.qkv: cannot run an FP8 weight here"):
            quant_linear.linear(x.view(2, 3, k), qw.to(DEVICE), bias)
        return
    got = quant_linear.linear(x.view(2, 3, k), qw.to(DEVICE), bias)
    assert got.shape == (2, 3, n) and got.dtype == torch.bfloat16
    want = ref_w8a16_linear(x, qw.data, qw.scales, bias, 16) if kind == "int8" else ref_fp8_linear(
        x, qw.data, qw.scales, bias)
    torch.testing.assert_close(got.view(6, n).cpu().float(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU path without Triton's interpreter")
def test_wrapper_int8_without_triton_dequantizes(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    qw = quant_linear.quantize(weight(20, 40), "int8")
    x, bias = inputs(3, 40, 20, torch.float32)
    check(quant_linear.linear(x, qw, bias), ref_w8a16_linear(x, qw.data, qw.scales, bias), torch.float32)


def _q(n: int = 32, k: int = 32):
    return (t.to(DEVICE) for t in quantize_int8(weight(n, k)))


REFUSALS = [
    (lambda: quant_linear.quantize(torch.ones(4, 4, dtype=torch.int32), "int8", name="layers.1.qkv"),
     r"layers\.1\.qkv: cannot quantize a weight of dtype torch\.int32"),
    (lambda: quant_linear.quantize(torch.ones(2, 4, 4), "int8", name="lm_head"), r"lm_head: .*2-D.*\(2, 4, 4\)"),
    (lambda: quant_linear.quantize(torch.eye(16).log(), "fp8", name="embed"), r"embed: .*inf or NaN"),
    (lambda: quant_linear.quantize(torch.ones(4, 4), "int4", name="layers.2.o"), r"layers\.2\.o: unknown .* 'int4'"),
    (lambda: quant_linear.quantize(torch.ones(4, 64), "int8", group_size=100, name="w"), r"w: group_size .* 100"),
    (lambda: quant_linear.quantize(torch.ones(20, 32), "fp8", name="layers.0.o"),
     r"layers\.0\.o: FP8 weights need .* divisible by 16.*\[20, 32\]"),
    (lambda: quant_linear.quantize(torch.ones(32, 32), "fp8", group_size=32, name="w"), r"w: FP8 .* group_size"),
    (lambda: w8a16_linear(torch.ones(2, 31, device=DEVICE), *_q(), name="layers.4.gate_up"),
     r"layers\.4\.gate_up: input x must be .*\[tokens, 32\].*\(2, 31\)"),
    (lambda: w8a16_linear(torch.ones(2, 32, device=DEVICE, dtype=torch.float64), *_q(), name="w"),
     r"w: input x must be fp32/bf16/fp16.*float64"),
    (lambda: w8a16_linear(torch.ones(2, 32, device=DEVICE), torch.ones(32, 32, device=DEVICE), torch.ones(32),
                          name="layers.5.down"), r"layers\.5\.down: an int8 weight must be .*torch\.float32"),
    (lambda: w8a16_linear(torch.ones(2, 32, device=DEVICE), next(_q()), torch.ones(32, 2, device=DEVICE),
                          name="w"), r"w\.scales: expected contiguous fp32 of shape \(32,\)"),
    (lambda: w8a16_linear(torch.ones(2, 32, device=DEVICE), *_q(), torch.ones(31, device=DEVICE), name="w"),
     r"w\.bias: expected a float tensor of shape \(32,\)"),
    (lambda: w8a16_linear(torch.ones(2, 32, device=DEVICE), *_q(), split_k=9), r"split_k must be in 1\.\.8"),
    (lambda: fp8_linear(torch.ones(2, 32), torch.ones(32, 32), torch.ones(32, 1), name="layers.6.qkv"),
     r"layers\.6\.qkv: an FP8 weight must be .*torch\.float32"),
    (lambda: fp8_linear(torch.ones(2, 16), *quantize_fp8(torch.ones(32, 32)), name="w"),
     r"w: input x must be .*\[tokens, 32\]"),
    (lambda: fp8_linear(torch.ones(2, 32), *quantize_fp8(torch.ones(32, 32)), act_scale="block", name="w"),
     r"w: act_scale must be one of token, tensor, got 'block'"),
]


@pytest.mark.parametrize("call,message", REFUSALS, ids=[f"refusal{i}" for i in range(len(REFUSALS))])
def test_refusals_name_the_tensor(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
