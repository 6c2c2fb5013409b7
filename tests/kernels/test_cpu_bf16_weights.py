"""bf16 weight panels (kernels/cpu/linear_bf16.c) and the fused decode step over them.

The bf16 build runs linear.c's code with the weights widened as they are loaded, so over weights
rounded to bf16 it must give the fp32 build's results bit for bit: GEMMs, folds, and whole decode
steps (with adapters served by lora.c and by the fold).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.kernels.cpu import linear
from loraplex.engine.kernels.cpu.linear import pack, packed_linear, packed_linear_fold
from loraplex.engine.models.llama import LlamaModel
from tests.kernels.test_cpu_decode_step import (
    PROMPTS,
    _both_paths,
    _decode,
    _fold_setup,
    _model_and_cache,
    _prefill,
)
from tests.kernels.test_cpu_lora_fold import fold_block

BF16 = torch.bfloat16


def rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).float()


@pytest.fixture
def packed_rows_only(monkeypatch):
    monkeypatch.setattr(linear, "PACKED_MAX_ROWS", 10**6)  # every batch through the packed kernel, not MKL


@pytest.mark.parametrize("m", [0, 1, 2, 3, 5, 8, 9, 31, 64, 65, 130])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 13), (1001, 577), (257, 1536)])
def test_bf16_panels_give_the_fp32_kernels_result_over_the_rounded_weights(m, n, k, packed_rows_only):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    rows, w, b = torch.randn(m, k + 3, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = rows[:, 1:1 + k]  # row views: strided rows, dense features
    pw = pack(w, dtype=BF16)
    assert pw.data.dtype == BF16 and pw.data.numel() == pack(w).data.numel()
    got = packed_linear(x, pw, b)
    assert torch.equal(got, packed_linear(x, pack(rounded(w)), b))
    want = F.linear(x.double(), rounded(w).double(), b.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=5e-4)  # fp32 sums over up to 1536 terms
    assert torch.equal(packed_linear(x, pw), packed_linear(x, pack(rounded(w))))  # without bias


def test_bf16_packing_rounds_each_weight_as_torch_does():
    """One panel of [k, NR] (linear.c's layout), each weight rounded to nearest even: ties, values that
    round up into the next binade, subnormals, huge values and infinities."""
    nr, k = linear.panel_columns(), 37
    g = torch.Generator().manual_seed(3)
    w = torch.randn(nr, k, generator=g) * torch.logspace(-40, 38, k).float()
    w[0, :8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 - 2**-10, 2**-130, 3.3e38, float("inf"),
                             -0.0])
    pw = pack(w, dtype=BF16)
    assert torch.equal(pw.data.view(k, nr), w.t().to(BF16))
    assert pw.data.view(k, nr)[0, 0] == 1.0 and pw.data.view(k, nr)[1, 0] == 1 + 2**-6  # ties to even


def test_packing_refuses_other_element_types():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pack(torch.randn(8, 4), dtype=torch.float16)


@pytest.mark.parametrize("in_features,widths,rank,tokens", [
    (64, (64, 32, 32), 8, 5),
    (576, (576, 192, 192), 16, 32),
    (1536, (576,), 16, 1),
])
def test_a_fold_over_bf16_panels_equals_the_fp32_fold_over_the_rounded_weights(in_features, widths, rank, tokens):
    g = torch.Generator().manual_seed(rank + tokens)
    n_out = sum(widths)
    x = torch.randn(tokens, in_features, generator=g)
    w = torch.randn(n_out, in_features, generator=g) * 0.05
    a = torch.randn(len(widths) * rank, in_features, generator=g) * 0.05
    b = torch.randn(n_out, rank, generator=g) * 0.05
    keep = (torch.rand(tokens, generator=g) < 0.6).to(torch.uint8)
    keep[0] = 1
    block = fold_block(a, b, widths, rank)
    got = packed_linear_fold(x, pack(w, dtype=BF16), block, widths, rank, keep)
    assert torch.equal(got, packed_linear_fold(x, pack(rounded(w)), block, widths, rank, keep))
    assert not torch.equal(got, packed_linear(x, pack(w, dtype=BF16)))  # the delta is there


def test_a_bf16_models_fused_decode_step_matches_its_per_op_path_and_the_fp32_step(monkeypatch):
    """Fused and per-op paths over bf16 panels agree bit for bit, and both equal the fp32 panels' step
    over the same (rounded) weights: the model table's element type reaches every projection and the
    LM head."""
    g = torch.Generator().manual_seed(0)
    model, storage = _model_and_cache("tiny", packed_dtype=BF16)
    assert model.layers[0][1].data.dtype == BF16 and model.lm_head_w.data.dtype == BF16
    _prefill(model, storage, g)
    ids = torch.randint(0, model.config.vocab_size, (len(PROMPTS),), generator=g)
    rows = torch.arange(len(PROMPTS))
    got = _both_paths(model, storage, ids, rows, monkeypatch)
    fp32 = LlamaModel(model.config, model.w)  # the same values in fp32 panels
    assert fp32.layers[0][1].data.dtype == torch.float32
    assert torch.equal(got, _decode(fp32, storage, ids, rows, None, True, monkeypatch))


def test_a_bf16_models_fold_and_lora_step_equals_the_fp32_step_over_the_rounded_weights(tmp_path, monkeypatch):
    """12 rows: adapter a folded into the GEMMs (lp_linear_fold_bf16), b served by lora.c, two base rows."""
    model, storage, slots, lora, token_slots, ids, prompts = _fold_setup(tmp_path, packed_dtype=BF16)
    assert lora.kernel_args()[2] is not None  # a fold
    rows, before = torch.arange(len(prompts)), storage.clone()
    got = _decode(model, storage, ids, rows, lora, True, monkeypatch, prompts)
    storage.copy_(before)
    want = _decode(LlamaModel(model.config, model.w), storage, ids, rows, lora, True, monkeypatch, prompts)
    assert torch.equal(got, want)


def test_a_step_over_projections_of_two_element_types_matches_its_per_op_path(monkeypatch):
    """Each projection carries its own element type in the model table (as a merged adapter's bf16 copy
    beside quantized projections needs): fp32 panels among bf16 ones, fused and per-op alike."""
    g = torch.Generator().manual_seed(2)
    model, storage = _model_and_cache("tiny", packed_dtype=BF16)
    model.layers[0] = model.layers[0]._replace(o=pack(model.w["layers.0.o"]))  # fp32 panels among bf16 ones
    _prefill(model, storage, g)
    ids = torch.randint(0, model.config.vocab_size, (len(PROMPTS),), generator=g)
    got = _both_paths(model, storage, ids, torch.arange(len(PROMPTS)), monkeypatch)
    fp32 = LlamaModel(model.config, model.w)  # the same (rounded) values, all in fp32 panels
    assert torch.equal(got, _decode(fp32, storage, ids, torch.arange(len(PROMPTS)), None, True, monkeypatch))


