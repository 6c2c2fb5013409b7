"""Multi-LoRA kernels (Triton SGMV/BGMV, and the torch fast path) on the test device against
kernels/reference.py: ranks, dtypes, adapter popularity, batch shapes, fused slices, bad inputs.

Tensors are built on the CPU from seeded generators and moved to the test device (--device), so every
device sees the same values; the references compute on the CPU, and results are compared there. On the
CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py), on CUDA natively.

The interpreter runs every Triton program in Python, so dimensions stay small and the grid of
parametrizations covers pairs (rank x dtype, pattern x shape x base tokens, module x kernel) rather
than the full cross product.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.engine.kernels.bgmv import bgmv_expand, bgmv_shrink
from loraplex.engine.kernels.lora_ops import (
    LoraBatchIndex,
    apply_lora,
    lora_shrink_expand,
    lora_shrink_expand_torch,
    triton_available,
)
from loraplex.engine.kernels.reference import ref_expand, ref_lora_shrink_expand, ref_shrink
from loraplex.engine.kernels.sgmv import sgmv_expand, sgmv_shrink
from tests.conftest import test_device
from tests.kernels import lora_batches

DEVICE = test_device()
assert triton_available(DEVICE), "on the CPU tests/conftest.py sets TRITON_INTERPRET=1"

HIDDEN = 96  # not a power of two: masks along in_features
# name -> (in_features, slice widths): qkv with GQA (4 heads, 2 kv heads, head_dim 16), gate_up, o, down
MODULES = {
    "qkv": (HIDDEN, (64, 32, 32)),
    "gate_up": (HIDDEN, (80, 80)),
    "o": (64, (HIDDEN,)),
    "down": (80, (HIDDEN,)),
}
NUM_SLOTS = 16
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
PATTERNS = ("distinct", "uniform", "zipf:1.5", "identical", "skewed")


def make_weights(module: str, r_max: int, dtype: torch.dtype, seed: int = 0, ranks: list[int] | None = None,
                 pad_garbage: bool = False, rank_major: bool = False):
    """Stacked A [slots, S*r_max, in] and B [slots, out, r_max] sized so that deltas are O(1); B contiguous,
    or with `rank_major` a view of [slots, r_max, out] storage (the slot buffers' layout)."""
    in_f, widths = MODULES[module]
    g = torch.Generator().manual_seed(seed)
    s = len(widths)
    a = torch.randn(NUM_SLOTS, s * r_max, in_f, generator=g) / in_f ** 0.5
    b = torch.randn(NUM_SLOTS, sum(widths), r_max, generator=g) / r_max ** 0.5
    if ranks is not None:  # rank < r_max: padding is zero, or finite garbage the kernels must skip
        for slot, rk in enumerate(ranks):
            fill = 7.0 if pad_garbage else 0.0
            a.view(NUM_SLOTS, s, r_max, in_f)[slot, :, rk:] = fill
            b[slot, :, rk:] = fill
    a, b = a.to(DEVICE, dtype), b.to(DEVICE, dtype)
    return a, b.mT.contiguous().mT if rank_major else b, widths


def make_batch(pattern: str, shape: str, with_base: bool, seed: int = 0) -> LoraBatchIndex:
    return lora_batches.make_batch(pattern, shape, with_base, NUM_SLOTS, seed, device=DEVICE)


def index_of(token_slots: list[int]) -> LoraBatchIndex:
    return LoraBatchIndex.from_token_slots(token_slots, DEVICE)


def ints(values: list[int]) -> torch.Tensor:
    """int32 on the test device: per-slot ranks, token slots, segment starts."""
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def inputs(index: LoraBatchIndex, module: str, dtype: torch.dtype, seed: int = 1):
    in_f, widths = MODULES[module]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(index.num_tokens, in_f, generator=g).to(DEVICE, dtype)
    out = torch.randn(index.num_tokens, sum(widths), generator=g).to(DEVICE, dtype)
    return x, out


def assert_close(got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """got (on the test device) against a reference computed on the CPU."""
    torch.testing.assert_close(got.cpu(), expected.cpu(), atol=atol, rtol=rtol)


def run_and_check(fn, kernel: str, index: LoraBatchIndex, module: str, r_max: int, dtype: torch.dtype,
                  ranks: list[int] | None = None, pad_garbage: bool = False, rank_major: bool = False,
                  weight_dtype: torch.dtype | None = None) -> None:
    """dtype: the activations' (x, out); weight_dtype: A's and B's (default the same)."""
    a, b, widths = make_weights(module, r_max, weight_dtype or dtype, ranks=ranks, pad_garbage=pad_garbage,
                                rank_major=rank_major)
    rk = ints(ranks) if ranks is not None else None
    x, out = inputs(index, module, dtype)
    expected = ref_lora_shrink_expand(x, out, a, b, index.token_slots, widths, rk)  # (on the CPU)
    got = out.clone()
    fn(x, got, a, b, index, slice_widths=widths, ranks=rk, kernel=kernel)
    atol, rtol = TOL[dtype]
    got, out, base = got.cpu(), out.cpu(), index.token_slots.cpu() < 0
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.equal(got[base], out[base]), "base-model (-1) rows must not be touched"
    if index.num_lora_tokens:  # the check is not vacuous: adapters really moved the output
        assert (expected.float() - out.float())[~base].abs().max() > 0.1


TRITON = [(lora_shrink_expand, "sgmv"), (lora_shrink_expand, "bgmv")]
TORCH = [(lora_shrink_expand_torch, "segments"), (lora_shrink_expand_torch, "gather")]


# ------------------------------------------------------------------------------ Triton kernels

@pytest.mark.parametrize("dtype,weight_dtype",
                         [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                          (torch.bfloat16, torch.float32)], ids=["f32-bf16", "f32-f16", "bf16-f32"])
@pytest.mark.parametrize("fn,kernel", TRITON + TORCH, ids=["sgmv", "bgmv", "torch-segments", "torch-gather"])
def test_weights_of_another_dtype_than_the_activations(fn, kernel: str, dtype, weight_dtype) -> None:
    """16-bit slot buffers under an fp32 model (EngineConfig.lora_dtype), or the reverse: the operands are
    multiplied in fp32, so the result is the reference's over the same weights, to the activations' tolerance."""
    ranks = [16, 8, 3, 16] * (NUM_SLOTS // 4)
    for shape, pattern in (("prefill", "skewed"), ("decode", "uniform")):
        run_and_check(fn, kernel, make_batch(pattern, shape, True), "qkv", 16, dtype, ranks=ranks, pad_garbage=True,
                      rank_major=True, weight_dtype=weight_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("r_max", [8, 16, 32, 64])
def test_ranks_and_dtypes(r_max: int, dtype: torch.dtype) -> None:
    """Every rank x dtype: SGMV on a prefill batch, BGMV on a decode batch, fused qkv, with -1 tokens;
    each over B as the slot buffers hold it (rank-major) and over a contiguous B."""
    for rank_major in (True, False):
        run_and_check(lora_shrink_expand, "sgmv", make_batch("skewed", "prefill", True), "qkv", r_max, dtype,
                      rank_major=rank_major)
        run_and_check(lora_shrink_expand, "bgmv", make_batch("uniform", "decode", True, seed=2), "qkv", r_max,
                      dtype, rank_major=rank_major)


@pytest.mark.parametrize("with_base", [False, True], ids=["lora-only", "with-base"])
@pytest.mark.parametrize("shape", ["prefill", "decode"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_popularity_auto_dispatch(pattern: str, shape: str, with_base: bool) -> None:
    """Every popularity pattern x batch shape x base tokens through the auto SGMV/BGMV choice, over the
    slot buffers' rank-major B."""
    index = make_batch(pattern, shape, with_base, seed=len(pattern))
    dtype = torch.bfloat16 if with_base else torch.float32
    run_and_check(lora_shrink_expand, "auto", index, "qkv", 16, dtype, rank_major=True)


def test_auto_picks_sgmv_for_long_segments_and_bgmv_for_decode() -> None:
    assert make_batch("skewed", "prefill", False).prefers_segments
    assert make_batch("identical", "decode", False).prefers_segments  # one 16-token segment
    assert not make_batch("distinct", "decode", False).prefers_segments
    assert not make_batch("uniform", "decode", True).prefers_segments


@pytest.mark.parametrize("fn,kernel", TRITON + TORCH, ids=["sgmv", "bgmv", "torch-segments", "torch-gather"])
@pytest.mark.parametrize("module", ["gate_up", "o", "down"])
def test_fused_slices(module: str, fn, kernel: str) -> None:
    """gate_up (2 equal slices) and single-slice o/down; qkv's unequal slices are covered above."""
    run_and_check(fn, kernel, make_batch("zipf:1.5", "prefill", True, seed=3), module, 16, torch.float32)


@pytest.mark.parametrize("fn,kernel", TRITON + TORCH, ids=["sgmv", "bgmv", "torch-segments", "torch-gather"])
@pytest.mark.parametrize("pad_garbage", [False, True], ids=["zero-pad", "garbage-pad"])
def test_ranks_tensor_skips_padding(fn, kernel: str, pad_garbage: bool) -> None:
    """Per-slot ranks < r_max (incl. 0): the padding beyond a slot's rank never contributes."""
    ranks = [32, 8, 0, 16, 24, 32, 1, 9] * 2
    run_and_check(fn, kernel, make_batch("uniform", "prefill", True, seed=4), "qkv", 32, torch.float32,
                  ranks=ranks, pad_garbage=pad_garbage)


@pytest.mark.parametrize("fn,kernel", TRITON + TORCH + [(lora_shrink_expand_torch, "grouped")],
                         ids=["sgmv", "bgmv", "torch-segments", "torch-gather", "torch-grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rank_major_b(fn, kernel: str, dtype: torch.dtype) -> None:
    """B as the slot buffers store it (rank-major: rows of B r_max apart become columns out apart), with
    mixed ranks and garbage in the padding rows: every path reads it through its strides."""
    ranks = [32, 8, 0, 16, 24, 32, 1, 9] * 2
    index = sorted_batch("uniform", True, seed=6) if kernel == "grouped" else make_batch("uniform", "prefill", True,
                                                                                         seed=6)
    run_and_check(fn, kernel, index, "qkv", 32, dtype, ranks=ranks, pad_garbage=True, rank_major=True)


def test_launchers_honour_ranks_one_by_one() -> None:
    """Shrink writes exact zeros beyond a slot's rank; expand ignores y's columns beyond it."""
    ranks = [32, 8, 0, 16, 24, 32, 1, 9] * 2
    rk = ints(ranks)
    index = LoraBatchIndex.from_segments([9, 1, 1, 1, 1, 6], [1, 2, 6, -1, 4, 8], DEVICE)
    a, b, widths = make_weights("qkv", 32, torch.float32, ranks=ranks, pad_garbage=True)
    x, out = inputs(index, "qkv", torch.float32)
    seg = dict(seg_starts=index.seg_starts, seg_slots=index.seg_slots, ranks=rk)
    y_ref = ref_shrink(x, a, index.token_slots, 3, rk)
    y_b = bgmv_shrink(x, a, index.token_slots, num_slices=3, ranks=rk)
    for y in (sgmv_shrink(x, a, num_slices=3, **seg), y_b):
        assert_close(y, y_ref)
    y_full = torch.randn(y_ref.shape, device=DEVICE)  # non-zero beyond each rank
    expected = ref_expand(y_full, b, out, index.token_slots, widths, rk)
    got_s, got_b = out.clone(), out.clone()
    sgmv_expand(y_full, b, got_s, slice_widths=widths, **seg)
    bgmv_expand(y_full, b, got_b, index.token_slots, slice_widths=widths, ranks=rk)
    assert_close(got_s, expected)
    assert_close(got_b, expected)


def test_cross_shapes() -> None:
    """SGMV on a decode batch (segments of one token) and BGMV on a prefill batch are still exact."""
    run_and_check(lora_shrink_expand, "sgmv", make_batch("distinct", "decode", True), "qkv", 8, torch.float16)
    run_and_check(lora_shrink_expand, "bgmv", make_batch("skewed", "prefill", False), "o", 8, torch.float16)


@pytest.mark.parametrize("split_k", [1, 3])
def test_small_tiles_and_split_k(split_k: int) -> None:
    """Several tiles per segment and slice (blocks of 16), multi-step K loops, split-K atomics."""
    index = LoraBatchIndex.from_segments([37, 3, 6], [2, -1, 7], DEVICE)
    a, b, widths = make_weights("qkv", 32, torch.float32)
    x, out = inputs(index, "qkv", torch.float32)
    seg = dict(seg_starts=index.seg_starts, seg_slots=index.seg_slots)
    y_ref = ref_shrink(x, a, index.token_slots, 3)
    y = sgmv_shrink(x, a, num_slices=3, split_k=split_k, block_m=16, block_n=16, block_k=16, **seg)
    assert_close(y, y_ref)
    small = index_of([4, -1, 9, 4, 0, 2])
    y_small = bgmv_shrink(x[:6].contiguous(), a, small.token_slots, num_slices=3, split_k=split_k,
                          block_n=16, block_k=16)
    assert_close(y_small, ref_shrink(x[:6], a, small.token_slots, 3))
    expected = ref_expand(y_ref, b, out, index.token_slots, widths)
    got = out.clone()
    sgmv_expand(y, b, got, slice_widths=widths, block_m=16, block_n=16, block_k=16, **seg)
    assert_close(got, expected)
    if split_k == 1:
        got = out[:6].clone()
        bgmv_expand(y_small, b, got, small.token_slots, slice_widths=widths, block_n=16, block_k=16)
        expected = ref_expand(y_small, b, out[:6], small.token_slots, widths)
        assert_close(got, expected)


def test_no_lora_tokens_is_a_no_op() -> None:
    index = index_of([-1] * 5)
    a, b, widths = make_weights("qkv", 8, torch.float32)
    x, out = inputs(index, "qkv", torch.float32)
    for fn, kernel in TRITON + TORCH:
        got = out.clone()
        fn(x, got, a, b, index, slice_widths=widths, kernel=kernel)
        assert torch.equal(got, out)
    y = sgmv_shrink(x, a, index.seg_starts, index.seg_slots, num_slices=3)
    assert not y.any()


# -------------------------------------------------------------------------------- torch path

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("r_max", [8, 16, 32, 64])
def test_torch_path_ranks_dtypes_patterns(r_max: int, dtype: torch.dtype) -> None:
    for pattern in PATTERNS:
        for shape in ("prefill", "decode"):
            for with_base in (False, True):
                index = make_batch(pattern, shape, with_base, seed=r_max)
                run_and_check(lora_shrink_expand_torch, "auto", index, "qkv", r_max, dtype, rank_major=with_base)


@pytest.mark.parametrize("rank_major", [False, True], ids=["contiguous-b", "rank-major-b"])
def test_apply_lora_takes_either_b_layout(rank_major: bool) -> None:
    """What a layer calls, on the test device: on the CPU the C kernel serves a rank-major B (the slot
    buffers'), torch ops a contiguous one; on CUDA the Triton kernels take both. The same answer."""
    index = make_batch("zipf:1.5", "decode", True)
    a, b, widths = make_weights("qkv", 16, torch.float32, rank_major=rank_major)
    x, out = inputs(index, "qkv", torch.float32)
    expected = ref_lora_shrink_expand(x, out, a, b, index.token_slots, widths)
    apply_lora(x, out, a, b, index, slice_widths=widths)
    assert_close(out, expected)


# ------------------------------------------------------------------------------ batch index

def test_index_from_token_slots_merges_runs() -> None:
    index = index_of([2, 2, -1, -1, 2, 0])
    assert index.seg_starts.tolist() == [0, 2, 4, 5, 6]
    assert index.seg_slots.tolist() == [2, -1, 2, 0]
    assert index.lora_segments == ((0, 2, 2), (4, 5, 2), (5, 6, 0))
    assert (index.num_tokens, index.max_seg_len, index.max_slot, index.num_lora_tokens) == (6, 2, 2, 4)
    merged = LoraBatchIndex.from_segments([3, 0, 2, 1], [1, 4, 1, -1], DEVICE)
    assert merged.seg_starts.tolist() == [0, 5, 6] and merged.seg_slots.tolist() == [1, -1]


# ------------------------------------------------------------------------------- bad inputs

def _good():
    index = index_of([0, 0, 1, -1])
    a, b, widths = make_weights("qkv", 8, torch.float32)
    x, out = inputs(index, "qkv", torch.float32)
    return dict(x=x, out=out, lora_a=a, lora_b=b, index=index, slice_widths=widths)


BAD = {
    "x and out of two dtypes": lambda k: k.update(x=k["x"].half()),
    "x wrong features": lambda k: k.update(x=k["x"][:, :-1].contiguous()),
    "x not contiguous": lambda k: k.update(x=k["x"].t().contiguous().t()),
    "x 1-d": lambda k: k.update(x=k["x"][0]),
    "out wrong width": lambda k: k.update(out=k["out"][:, 1:].contiguous()),
    "out wrong tokens": lambda k: k.update(out=k["out"][1:]),
    "out wrong dtype": lambda k: k.update(out=k["out"].double()),
    "b dtype differs": lambda k: k.update(lora_b=k["lora_b"].half()),
    "b slot count": lambda k: k.update(lora_b=k["lora_b"][1:]),
    "b neither layout": lambda k: k.update(lora_b=k["lora_b"].transpose(0, 1).contiguous().transpose(0, 1)),
    "a rows not S*r": lambda k: k.update(lora_a=k["lora_a"][:, 1:].contiguous()),
    "widths sum": lambda k: k.update(slice_widths=(64, 32, 31)),
    "widths count": lambda k: k.update(slice_widths=(64, 64)),
    "unequal default split": lambda k: k.update(slice_widths=None, lora_b=k["lora_b"][:, :127].contiguous(),
                                                out=k["out"][:, :127].contiguous()),
    "ranks wrong length": lambda k: k.update(ranks=ints([1] * 3)),
    "ranks float": lambda k: k.update(ranks=torch.ones(NUM_SLOTS, device=DEVICE)),
    "ranks negative": lambda k: k.update(ranks=ints([-1] * NUM_SLOTS)),
    "index tokens": lambda k: k.update(index=index_of([0, 1, 2])),
    "index slot too big": lambda k: k.update(index=index_of([0, 0, NUM_SLOTS, 1])),
    "index not an index": lambda k: k.update(index=[0, 0, 1, -1]),
    "unknown kernel": lambda k: k.update(kernel="cuda"),
}


@pytest.mark.parametrize("fn", [lora_shrink_expand, lora_shrink_expand_torch], ids=["triton", "torch"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise(case: str, fn) -> None:
    if case == "ranks negative" and DEVICE.type != "cpu":
        pytest.skip(f"ranks' values are checked on the CPU only (it would cost a sync per call on {DEVICE})")
    kwargs = _good()
    BAD[case](kwargs)
    if fn is lora_shrink_expand_torch and kwargs.get("kernel") == "cuda":
        kwargs["kernel"] = "sgmv"  # a Triton-only name is unknown to the torch path
    with pytest.raises(ValueError):
        fn(**kwargs)


def test_bad_launcher_inputs_raise() -> None:
    k = _good()
    x, a, b, out, index = k["x"], k["lora_a"], k["lora_b"], k["out"], k["index"]
    y = ref_shrink(x, a, index.token_slots, 3).to(DEVICE)
    starts, slots = index.seg_starts, index.seg_slots
    values = dict(check_values=True)  # (the default off the CPU is not to check values: no device sync)
    cases = [
        lambda: sgmv_shrink(x, a, starts[:-1], slots, num_slices=3),  # starts length
        lambda: sgmv_shrink(x, a, ints([0, 2, 9, 4]), slots, **values),  # not rising to T
        lambda: sgmv_shrink(x, a, starts, ints([0, 99, -1]), **values),  # slot range
        lambda: sgmv_shrink(x, a, starts.float(), slots),  # index dtype
        lambda: sgmv_shrink(x, a, starts, slots, split_k=0),
        lambda: sgmv_shrink(x, a, starts, slots, block_m=24),  # not a power of two
        lambda: sgmv_shrink(x, a, starts, slots, num_slices=5),  # 24 rows do not split in 5
        lambda: sgmv_shrink(x, a, starts, slots, y=torch.zeros(4, 24, dtype=torch.float16, device=DEVICE)),
        lambda: sgmv_expand(y.half(), b, out, starts, slots),  # y must be fp32
        lambda: sgmv_expand(y[:, :20].contiguous(), b, out, starts, slots),  # not S * r_max
        lambda: bgmv_shrink(x, a, index.token_slots[:3]),
        lambda: bgmv_shrink(x, a, ints([0, 0, -2, 1]), **values),
        lambda: bgmv_expand(y, b, out, index.token_slots, slice_widths=(64, 64)),
        lambda: bgmv_expand(y, b.transpose(1, 2), out, index.token_slots),
    ]
    for i, case in enumerate(cases):
        with pytest.raises(ValueError):
            case()
            pytest.fail(f"case {i} did not raise")


# ------------------------------------------------------------------------------ grouped torch path

def sorted_batch(pattern: str, with_base: bool, seed: int) -> LoraBatchIndex:
    """A decode batch sorted by slot, as the scheduler orders it: one run of tokens per slot."""
    slots = sorted(lora_batches.request_slots(pattern, 16, with_base, np.random.default_rng(seed), NUM_SLOTS))
    return index_of(slots)


@pytest.mark.parametrize("module", ["qkv", "gate_up", "o", "down"])
@pytest.mark.parametrize("pattern", ["distinct", "uniform", "zipf:1.5", "skewed"])
@pytest.mark.parametrize("with_base", [False, True])
def test_grouped_path_matches_reference(module: str, pattern: str, with_base: bool) -> None:
    index = sorted_batch(pattern, with_base, seed=3)
    if pattern == "distinct":
        assert index.grouped_layout is not None
    kernel = "grouped" if index.grouped_layout is not None else "auto"
    run_and_check(lora_shrink_expand_torch, kernel, index, module, 16, torch.float32)


@pytest.mark.parametrize("with_base", [False, True])
def test_grouped_path_leaves_long_runs_to_their_own_gemm(with_base: bool) -> None:
    slots = ([-1] * 3 if with_base else []) + [0] * 9 + [1, 2, 3, 4, 6]
    index = index_of(slots)
    assert [seg[2] for seg in index.heavy_segments] == [0]
    assert index.grouped_layout is not None and index.grouped_layout.max_len == 1
    run_and_check(lora_shrink_expand_torch, "grouped", index, "gate_up", 16, torch.float32)


@pytest.mark.parametrize("pad_garbage", [False, True])
def test_grouped_path_honours_ranks(pad_garbage: bool) -> None:
    ranks = [4, 8, 16, 12] * (NUM_SLOTS // 4)
    run_and_check(lora_shrink_expand_torch, "grouped", sorted_batch("distinct", True, 5), "qkv", 16, torch.float32,
                  ranks=ranks, pad_garbage=pad_garbage)


def test_grouped_path_is_skipped_for_sparse_or_split_slots() -> None:
    assert index_of([0, 0, 1]).grouped_layout is None  # too few adapters
    assert index_of([0, 1, 0, 2]).grouped_layout is None  # slot 0 in two runs
    assert index_of([0, 1, 2, 40]).grouped_layout is None  # range far wider than used


def test_grouped_path_without_padding_adds_in_place() -> None:
    index = index_of(list(range(8)))  # one token per slot, every token adapted
    assert index.grouped_layout.identity
    run_and_check(lora_shrink_expand_torch, "grouped", index, "gate_up", 16, torch.float32)
