"""The CPU multi-LoRA C kernel (kernels/cpu/lora.c through cpu/lora.py) against kernels/reference.py:
ranks (mixed per slot, garbage padding), fused slices of unequal widths, sizes off the SIMD width,
adapter popularity, decode- and prefill-shaped batches, base tokens, threads, bad inputs, and that
apply_lora really runs it on the CPU. Slot buffers of fp32, bf16 and fp16 (WEIGHT_DTYPES): the 16-bit
builds widen each weight exactly, so they must match the reference over the same rounded weights in fp32.

The kernel must be built here: a failing build fails these tests instead of skipping them.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels import lora_ops
from loraplex.engine.kernels.cpu import build
from loraplex.engine.kernels.cpu import lora as cpu_lora
from loraplex.engine.kernels.cpu.lora import lora_available, lora_shrink_expand_cpu
from loraplex.engine.kernels.lora_ops import LoraBatchIndex, apply_lora, stacked_b
from loraplex.engine.kernels.reference import ref_lora_shrink_expand
from tests.kernels import lora_batches

NUM_SLOTS = 12
# name -> (in_features, slice widths): sizes off multiples of 8 exercise the masked tails
MODULES = {
    "qkv": (45, (37, 21, 21)),  # GQA-like: q wider than k and v
    "qkv_even": (96, (64, 32, 32)),
    "gate_up": (61, (70, 70)),
    "o": (37, (45,)),
    "down": (70, (45,)),
    "tiny": (3, (5,)),
    "four": (24, (9, 1, 17, 8)),
    "smollm_qkv": (576, (576, 192, 192)),  # big enough for the parallel path
    "smollm_gate_up": (576, (1536, 1536)),
    "wide": (1001, (37, 24)),  # in_features over several shrink passes, with a masked tail
}
PATTERNS = ("distinct", "uniform", "zipf:1.5", "identical", "skewed")
ATOL = RTOL = 1e-4
WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WEIGHT_IDS = ["f32", "bf16", "f16"]


def make_weights(module: str, r_max: int, ranks: list[int] | None = None, pad: float | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
    """A [slots, S*r_max, in], B [slots, out, r_max] (rank-major) of `dtype` with O(1) deltas; beyond each
    slot's rank the padding is zero, or `pad` (NaN, huge values) that the kernel must never read into out."""
    in_f, widths = MODULES[module]
    g = torch.Generator().manual_seed(seed)
    s = len(widths)
    a = torch.randn(NUM_SLOTS, s * r_max, in_f, generator=g) / in_f ** 0.5  # [slots, S*r_max, in]
    b = torch.randn(NUM_SLOTS, sum(widths), r_max, generator=g) / r_max ** 0.5  # [slots, out, r_max]
    if ranks is not None:
        for slot, rk in enumerate(ranks):
            fill = 0.0 if pad is None else pad
            a.view(NUM_SLOTS, s, r_max, in_f)[slot, :, rk:] = fill
            b[slot, :, rk:] = fill
    # B rank-major, as the slot buffers hold it (lora.c requires it)
    return a.to(dtype), b.mT.contiguous().to(dtype).mT, widths


def make_batch(pattern: str, shape: str, with_base: bool, seed: int = 0) -> LoraBatchIndex:
    return lora_batches.make_batch(pattern, shape, with_base, NUM_SLOTS, seed, prefill_len=(5, 40), decodes=12)


def check(index: LoraBatchIndex, module: str, r_max: int = 16, ranks: list[int] | None = None,
          pad: float | None = None, rank_dtype: torch.dtype = torch.int32, fn=lora_shrink_expand_cpu,
          dtype: torch.dtype = torch.float32) -> None:
    a, b, widths = make_weights(module, r_max, ranks, pad, dtype=dtype)
    rk = torch.tensor(ranks, dtype=rank_dtype) if ranks is not None else None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(index.num_tokens, a.shape[2], generator=g)  # [T, in]
    out = torch.randn(index.num_tokens, sum(widths), generator=g)  # [T, out]
    expected = ref_lora_shrink_expand(x, out, a.float(), b.float(), index.token_slots, widths, rk)
    got = out.clone()
    fn(x, got, a, b, index, slice_widths=widths, ranks=rk)
    assert torch.isfinite(got).all(), "padding beyond a slot's rank leaked into out"
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    untouched = index.token_slots < 0
    if rk is not None:
        untouched |= (rk.long().clamp(max=r_max)[index.token_slots.long().clamp(min=0)] == 0)
    assert torch.equal(got[untouched], out[untouched]), "rows without a delta must not be touched"
    if index.num_lora_tokens and not bool(untouched.all()):  # not vacuous: adapters moved the output
        assert (expected - out)[~untouched].abs().max() > 0.05


# ------------------------------------------------------------------------------------- availability

def test_kernel_is_built_here() -> None:
    """No skip: on this machine the C kernels must build (a failure shows the compiler's message)."""
    build.build()  # raises RuntimeError with the compiler output when the sources do not compile
    assert build.library() is not None
    assert lora_available()


def test_apply_lora_uses_the_c_kernel_on_cpu_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lora_ops.cpu_lora_kernel() is lora_shrink_expand_cpu
    calls: list[str] = []
    real = cpu_lora._lora()
    monkeypatch.setattr(cpu_lora, "_lora", lambda dtype=torch.float32: (calls.append("c"), real)[1])

    def no_torch(*args, **kwargs):
        raise AssertionError("apply_lora took the torch path on CPU fp32")

    monkeypatch.setattr(lora_ops, "lora_shrink_expand_torch", no_torch)
    check(make_batch("zipf:1.5", "decode", True), "qkv", ranks=[16, 8] * 6, fn=apply_lora)
    assert calls == ["c"]


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES[1:], ids=WEIGHT_IDS[1:])
def test_apply_lora_runs_16_bit_slots_under_fp32_activations_in_c(dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """16-bit slot buffers under an fp32 model (EngineConfig.lora_dtype) take lora.c's widening build, and
    the torch path (no C kernels) gives the same answer by casting the weights it uses."""
    def no_torch(*args, **kwargs):
        raise AssertionError("apply_lora took the torch path for fp32 activations")

    with monkeypatch.context() as m:
        m.setattr(lora_ops, "lora_shrink_expand_torch", no_torch)
        check(make_batch("zipf:1.5", "decode", True), "qkv", ranks=[16, 8] * 6, fn=apply_lora, dtype=dtype)
    for shape in ("decode", "prefill"):
        check(make_batch("skewed", shape, True), "qkv", ranks=[16, 8] * 6, fn=lora_ops.lora_shrink_expand_torch,
              dtype=dtype)


def test_apply_lora_keeps_torch_for_other_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[str] = []
    real = lora_ops.lora_shrink_expand_torch
    monkeypatch.setattr(lora_ops, "lora_shrink_expand_torch", lambda *a, **k: (used.append("torch"), real(*a, **k)))
    index = make_batch("uniform", "decode", True)
    a, b, widths = make_weights("o", 8)
    x, out = torch.randn(index.num_tokens, 37).bfloat16(), torch.zeros(index.num_tokens, 45).bfloat16()
    apply_lora(x, out, a.bfloat16(), b.bfloat16(), index, slice_widths=widths)
    assert used == ["torch"]


def test_disabled_kernels_fall_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """LORAPLEX_CPU_KERNELS=0: no library, apply_lora runs torch ops and gives the same answer."""
    caches = (build.library, cpu_lora._lora, lora_ops.cpu_lora_kernel)
    monkeypatch.setenv("LORAPLEX_CPU_KERNELS", "0")
    for c in caches:
        c.cache_clear()
    try:
        assert lora_ops.cpu_lora_kernel() is None
        with pytest.raises(RuntimeError, match="not built"):
            lora_shrink_expand_cpu(torch.zeros(1, 3), torch.zeros(1, 5), *make_weights("tiny", 4)[:2],
                                   LoraBatchIndex.from_token_slots([0]))
        check(make_batch("skewed", "prefill", True), "qkv", fn=apply_lora)
    finally:
        monkeypatch.delenv("LORAPLEX_CPU_KERNELS")
        for c in caches:
            c.cache_clear()
    assert lora_ops.cpu_lora_kernel() is lora_shrink_expand_cpu


# ------------------------------------------------------------------------------------- correctness

@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=WEIGHT_IDS)
@pytest.mark.parametrize("r_max", [4, 8, 16, 32, 64])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_ranks_mixed_across_slots(r_max: int, shape: str, dtype: torch.dtype) -> None:
    """Every r_max with per-slot ranks from 0 to r_max (odd ones too) and NaN beyond them."""
    ranks = [r_max, max(1, r_max // 2), 0, r_max - 1, 1, max(1, r_max - 3)] * 2
    check(make_batch("uniform", shape, True, seed=r_max), "qkv", r_max, ranks, pad=float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=WEIGHT_IDS)
@pytest.mark.parametrize("pad", [float("nan"), 1e30, float("inf")], ids=["nan", "huge", "inf"])
@pytest.mark.parametrize("module", ["qkv_even", "gate_up", "down"])
def test_padding_garbage_never_leaks(module: str, pad: float, dtype: torch.dtype) -> None:
    ranks = [16, 8, 0, 12, 3, 16, 9, 1, 15, 16, 4, 7]
    check(make_batch("skewed", "prefill", False, seed=5), module, 16, ranks, pad=pad, dtype=dtype)
    check(make_batch("uniform", "decode", True, seed=6), module, 16, ranks, pad=pad, dtype=dtype)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=WEIGHT_IDS)
@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_slices_and_odd_sizes(module: str, shape: str, dtype: torch.dtype) -> None:
    """1 to 4 slices of unequal widths, in/out sizes not multiples of 8 (the 16-bit builds' part vectors
    too), tiles with partial columns."""
    check(make_batch("zipf:1.5", shape, True, seed=3), module, 16, dtype=dtype)
    check(make_batch("distinct", shape, False, seed=4), module, 8, ranks=[8, 5] * 6, pad=float("nan"), dtype=dtype)


@pytest.mark.parametrize("seed,dtype", [(0, torch.float32), (1, torch.float32), (0, torch.bfloat16)],
                         ids=["0-f32", "1-f32", "0-bf16"])
@pytest.mark.parametrize("pattern", ["distinct", "uniform", "skewed"])
@pytest.mark.parametrize("module", ["smollm_qkv", "smollm_gate_up"])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_bits_do_not_depend_on_how_the_work_is_split(module: str, shape: str, pattern: str, seed: int,
                                                     dtype: torch.dtype) -> None:
    """Every row of the shrink and every output of the expand is summed the same way whichever rows
    or outputs share its call (the dot products' horizontal sums in one order, a tile cut by a split
    still taken by the tile kernel), so one thread and two give the same bits."""
    index = make_batch(pattern, shape, True, seed=seed)  # (most of these cases failed before the change)
    ranks = [20, 16, 7, 32, 12, 20, 16, 9, 32, 20, 1, 24]  # 20: a whole tile and a part; 7: dot only
    a, b, widths = make_weights(module, 32, ranks, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(index.num_tokens, a.shape[2], generator=g)  # [T, in]
    out = torch.randn(index.num_tokens, sum(widths), generator=g)  # [T, out]
    rk = torch.tensor(ranks, dtype=torch.int32)
    prev = torch.get_num_threads()
    got = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = out.clone()
            lora_shrink_expand_cpu(x, got[threads], a, b, index, slice_widths=widths, ranks=rk)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(got[1], got[2])
    expected = ref_lora_shrink_expand(x, out, a.float(), b.float(), index.token_slots, widths, rk)
    torch.testing.assert_close(got[2], expected, atol=ATOL, rtol=RTOL)
    if shape == "prefill":  # the tile kernel served a block: 16+ tokens of one slot
        counts = torch.bincount(index.token_slots[index.token_slots >= 0].long(), minlength=NUM_SLOTS)
        assert int(counts.max()) >= 16


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=WEIGHT_IDS)
@pytest.mark.parametrize("with_base", [False, True], ids=["lora-only", "with-base"])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_popularity_patterns(pattern: str, shape: str, with_base: bool, dtype: torch.dtype) -> None:
    check(make_batch(pattern, shape, with_base, seed=len(pattern)), "qkv", 16, dtype=dtype)


def test_scattered_tokens_of_one_slot_and_long_segments() -> None:
    """Tokens of a slot spread over the batch form one group; groups longer than a block (64 tokens) split."""
    slots = [2, 7, 2, -1, 2, 7, 0] * 9 + [4] * 70 + [-1] * 5 + [4] * 3
    check(LoraBatchIndex.from_token_slots(slots), "qkv", 16, ranks=[16, 3] * 6, pad=float("nan"))
    check(LoraBatchIndex.from_segments([300], [1]), "smollm_qkv", 16)


# token slots of a 32-token decode batch: one adapter, zipf-like counts (9, 6, 3, 2, 2, 1, ..), one each
DECODE_32 = {
    "identical": [3] * 32,
    "skewed": [0] * 9 + [1] * 6 + [2] * 3 + [4, 4, 5, 5] + list(range(6, 12)) + [-1] * 4,
    "round-robin": [i % NUM_SLOTS for i in range(32)],
}


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=WEIGHT_IDS)
@pytest.mark.parametrize("module", ["smollm_qkv", "smollm_gate_up"])
@pytest.mark.parametrize("slots", list(DECODE_32.values()), ids=list(DECODE_32))
def test_decode_batch_of_smollm_shapes_on_one_and_all_threads(slots: list[int], module: str, dtype) -> None:
    """Big enough for the parallel path (each weight row read by one thread); one thread must give the
    same answer."""
    index = LoraBatchIndex.from_token_slots(slots)
    check(index, module, 16, ranks=[16, 16, 4, 16, 0, 16] * 2, pad=float("nan"), dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check(index, module, 16, ranks=[16, 16, 4, 16, 0, 16] * 2, pad=float("nan"), dtype=dtype)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=WEIGHT_IDS)
@pytest.mark.parametrize("module", ["wide", "smollm_qkv"])
@pytest.mark.parametrize("tokens", [3, 5, 7, 12, 13, 16, 32, 33, 65])
def test_many_tokens_of_one_slot(tokens: int, module: str, dtype: torch.dtype) -> None:
    """A slot with many tokens, next to slots of one or two: near-equal groups of 3 to 6 tokens; below
    16 tokens dot products over rows in pairs (odd ranks leave one over), from 16 a GEMM over 16-row
    tiles of A (partial for ranks below 16); features in several passes, with a masked tail."""
    slots = [0] * tokens + [1, -1, 2, 2] + [1] * (tokens // 2)
    check(LoraBatchIndex.from_token_slots(slots), module, 16, ranks=[5, 16, 3] + [16] * 9, pad=float("nan"),
          dtype=dtype)


@pytest.mark.parametrize("slots", [[3], [-1], [-1] * 7, [-1, 2, -1], [0, -1, -1, -1]],
                         ids=["one-token", "one-base-token", "all-base", "one-lora-token", "lora-then-base"])
def test_edge_batches(slots: list[int]) -> None:
    check(LoraBatchIndex.from_token_slots(slots), "gate_up", 16)


def test_empty_batch_and_rank_edge_values() -> None:
    a, b, widths = make_weights("o", 8)
    x, out = torch.zeros(0, 37), torch.zeros(0, 45)
    lora_shrink_expand_cpu(x, out, a, b, LoraBatchIndex.from_token_slots([]), slice_widths=widths)
    # ranks above r_max are clamped to it (as in the reference); int64 ranks work too
    check(make_batch("uniform", "decode", True), "o", 8, ranks=[8, 100, 3, 0] * 3, rank_dtype=torch.int64)
    check(make_batch("uniform", "decode", True), "o", 8, ranks=[0] * NUM_SLOTS)  # every slot empty


def test_default_slice_widths_and_repeat_calls_accumulate() -> None:
    """slice_widths=None splits equally; a second call adds the delta again (out += delta)."""
    index = make_batch("skewed", "decode", True)
    a, b, widths = make_weights("gate_up", 16)
    x = torch.randn(index.num_tokens, 61)
    out = torch.zeros(index.num_tokens, 140)
    lora_shrink_expand_cpu(x, out, a, b, index)
    once = out.clone()
    lora_shrink_expand_cpu(x, out, a, b, index)
    torch.testing.assert_close(out, 2 * once, atol=ATOL, rtol=RTOL)
    expected = ref_lora_shrink_expand(x, torch.zeros_like(out), a, b, index.token_slots, widths)
    torch.testing.assert_close(once, expected, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------- bad inputs

def _good():
    index = LoraBatchIndex.from_token_slots([0, 1, -1, 1])
    a, b, widths = make_weights("qkv", 8)  # A [12, 24, 45], B [12, 79, 8]
    x, out = torch.randn(4, 45), torch.zeros(4, 79)
    return dict(x=x, out=out, lora_a=a, lora_b=b, index=index, slice_widths=widths,
                ranks=torch.full((NUM_SLOTS,), 8, dtype=torch.int32))


def _call(**kw) -> None:
    args = _good()
    args.update(kw)
    lora_shrink_expand_cpu(args["x"], args["out"], args["lora_a"], args["lora_b"], args["index"],
                           slice_widths=args["slice_widths"], ranks=args["ranks"])


@pytest.mark.parametrize("change,match", [
    (lambda g: dict(x=g["x"].double()), "x must be float32"),
    (lambda g: dict(out=g["out"].half()), "out must be float32"),
    (lambda g: dict(lora_a=g["lora_a"].double()), "lora_a must be float32, bfloat16 or float16"),
    (lambda g: dict(lora_b=g["lora_b"].double()), "lora_b must be float32, bfloat16 or float16"),
    (lambda g: dict(lora_a=g["lora_a"].bfloat16()), "lora_b dtype torch.float32 differs from lora_a dtype"),
    (lambda g: dict(x=torch.randn(45, 4).t()), "x must be contiguous"),
    (lambda g: dict(out=torch.zeros(79, 4).t()), "out must be contiguous"),
    (lambda g: dict(lora_a=g["lora_a"].transpose(1, 2).contiguous().transpose(1, 2)), "lora_a must be contiguous"),
    (lambda g: dict(lora_b=g["lora_b"].contiguous()), "lora_b must be rank-major"),
    (lambda g: dict(lora_b=g["lora_b"][:, :, ::2]), "lora_b must be rank-major"),
    (lambda g: dict(x=g["x"][None]), "x must have 2 dimensions"),
    (lambda g: dict(lora_b=g["lora_b"][0]), "lora_b must have 3 dimensions"),
    (lambda g: dict(x=[[0.0]]), "x must be a torch.Tensor"),
    (lambda g: dict(x=torch.randn(4, 44)), "x has 44 features but lora_a expects in_features=45"),
    (lambda g: dict(out=torch.zeros(4, 80)), r"out must have shape \(4, 79\)"),
    (lambda g: dict(out=torch.zeros(3, 79)), r"out must have shape \(4, 79\)"),
    (lambda g: dict(lora_b=g["lora_b"][:5]), "lora_a has 12 slots but lora_b has 5"),
    (lambda g: dict(lora_b=stacked_b(NUM_SLOTS, 79, 5)), "must be num_slices \\* r_max"),
    (lambda g: dict(slice_widths=(37, 21, 20)), "slice_widths"),
    (lambda g: dict(slice_widths=(37, 42)), "slice_widths"),
    (lambda g: dict(slice_widths=None), "do not split into 3 equal slices"),
    (lambda g: dict(ranks=torch.full((NUM_SLOTS,), 8.0)), "ranks must be an int32 or int64 tensor"),
    (lambda g: dict(ranks=torch.full((5,), 8, dtype=torch.int32)), "one entry per slot"),
    (lambda g: dict(ranks=torch.full((NUM_SLOTS, 2), 8, dtype=torch.int32)[:, 0]), "contiguous"),
    (lambda g: dict(index=LoraBatchIndex.from_token_slots([0, 1])), "index describes 2 tokens but x has 4"),
    (lambda g: dict(index=LoraBatchIndex.from_token_slots([0, 1, 2, NUM_SLOTS])), "there are 12 slots"),
    (lambda g: dict(index=[0, 1, -1, 1]), "index must be a LoraBatchIndex"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_inputs_raise_value_error(change, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _call(**change(_good()))


def test_too_many_slices_and_rank_bound() -> None:
    with pytest.raises(ValueError, match="slices per fused projection"):
        _call(lora_a=torch.zeros(NUM_SLOTS, 40, 45), lora_b=stacked_b(NUM_SLOTS, 79, 8),
              slice_widths=(16,) * 4 + (15,))
    with pytest.raises(ValueError, match="r_max"):
        _call(lora_a=torch.zeros(NUM_SLOTS, 300, 45), lora_b=stacked_b(NUM_SLOTS, 79, 300), slice_widths=(79,))
