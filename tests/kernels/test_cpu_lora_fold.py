"""One adapter folded into the packed GEMM (linear.c's fold, lora_fold.c's packing) against plain torch.

The block layout is built here independently from lora_fold.c's Semantics, so the GEMM and the
packer are each checked against the documented layout, and together against x @ W^T + (x @ A^T) @ B^T.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu import linear
from loraplex.engine.kernels.cpu.decode_step import LORA_MODULES, DecodeStepLora

pytestmark = pytest.mark.skipif(not linear.linear_available(), reason="the CPU kernels are not built")

NR = linear.panel_columns() if linear.linear_available() else 0


def _slice_of(widths: tuple[int, ...], n: int) -> int:
    for s, w in enumerate(widths):
        if n < w:
            return s
        n -= w
    raise IndexError(n)


def fold_block(a: torch.Tensor, b: torch.Tensor, widths: tuple[int, ...], rank: int) -> torch.Tensor:
    """The documented layout: a [S * rank, K] (slice s's rows at s * rank), b [N, rank] (each output
    column's row of its slice's B) -> ap [pa, K, aw] then per output panel its [len, NR] block, where
    the shrink panels are aw = min(NR, S * rank rounded up to whole vectors of NR / 3) wide."""
    k, rows = a.shape[1], a.shape[0]
    vw = NR // 3
    aw = min(NR, -(-rows // vw) * vw)
    pa = -(-rows // aw)
    ap = torch.zeros(pa * aw, k)
    ap[:rows] = a
    parts = [ap.view(pa, aw, k).transpose(1, 2).reshape(-1)]
    n_out = sum(widths)
    for p in range(-(-n_out // NR)):
        cols = range(p * NR, min(n_out, p * NR + NR))
        s0, s1 = _slice_of(widths, cols[0]), _slice_of(widths, cols[-1])
        blk = torch.zeros((s1 - s0 + 1) * rank, NR)
        for j, n in enumerate(cols):
            s = _slice_of(widths, n)
            blk[(s - s0) * rank:(s - s0 + 1) * rank, j] = b[n]
        parts.append(blk.reshape(-1))
    return torch.cat(parts)


def reference(x, w, a, b, widths, rank, keep):
    """x @ W^T + the slice-wise LoRA delta, in the rows keep marks."""
    delta = torch.empty(x.shape[0], sum(widths), dtype=torch.float64)
    off = 0
    for s, width in enumerate(widths):
        ys = x.double() @ a[s * rank:(s + 1) * rank].double().T  # [T, rank]
        delta[:, off:off + width] = ys @ b[off:off + width].double().T
        off += width
    if keep is not None:
        delta *= keep.double()[:, None]
    return x.double() @ w.double().T + delta


@pytest.mark.parametrize("in_features,widths,rank,tokens", [
    (64, (64, 32, 32), 8, 5),        # a panel straddles the q/k boundary (24 or 48 columns); one row group
    (96, (40, 30), 29, 70),          # odd rank: 58 rows in 2-3 shrink panels; more rows than a row block
    (576, (576, 192, 192), 16, 32),  # the default model's qkv: two threads share the panels
    (1536, (576,), 16, 1),           # down at one row: a padded shrink panel
    (128, (96, 96, 64), 64, 9),      # rank 64 over 3 slices: 4-8 shrink panels; two row groups
])
@pytest.mark.parametrize("masked", [False, True])
def test_folded_gemm_adds_the_adapter_delta_to_the_kept_rows(in_features, widths, rank, tokens, masked):
    g = torch.Generator().manual_seed(rank * 1000 + tokens)
    n_out = sum(widths)
    x = torch.randn(tokens, in_features, generator=g)
    w = torch.randn(n_out, in_features, generator=g) * 0.05
    a = torch.randn(len(widths) * rank, in_features, generator=g) * 0.05
    b = torch.randn(n_out, rank, generator=g) * 0.05
    keep = None
    if masked:  # a random subset, with the first row in it and (given two or more) the last out of it
        keep = (torch.rand(tokens, generator=g) < 0.6).to(torch.uint8)
        keep[-1], keep[0] = 0, 1
    block = fold_block(a, b, widths, rank)
    assert block.numel() == linear.fold_module_floats(in_features, widths, rank)
    packed = linear.pack(w)
    got = linear.packed_linear_fold(x, packed, block, widths, rank, keep)
    torch.testing.assert_close(got.double(), reference(x, w, a, b, widths, rank, keep), rtol=1e-4, atol=1e-4)
    plain = linear.packed_linear(x, packed)
    if keep is not None:  # rows without the adapter: exactly the plain GEMM (their extension adds zeros)
        assert torch.equal(got[keep == 0], plain[keep == 0])
    assert not torch.allclose(got, plain)


def test_folded_gemm_refuses_a_block_of_the_wrong_size():
    packed = linear.pack(torch.randn(48, 32))
    block = torch.zeros(linear.fold_module_floats(32, (48,), 8) - 1)
    with pytest.raises(ValueError, match="fold block has"):
        linear.packed_linear_fold(torch.randn(3, 32), packed, block, (48,), 8)
    with pytest.raises(ValueError, match="do not fit"):
        linear.packed_linear_fold(torch.randn(3, 32), packed, torch.zeros(10), (40,), 8)


@pytest.mark.parametrize("slot_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_packing_a_slot_reads_only_its_live_rank_and_follows_the_layout(slot_dtype):
    """lora_fold.c over a LoRA table whose padding (rows and columns past the slot's rank) holds
    garbage: the block must be built from the live rank alone, module by module, layer by layer.
    16-bit slot buffers are widened into the fp32 block exactly."""
    g = torch.Generator().manual_seed(5)
    r_max, slots, layers, rank = 8, 3, 2, 5
    dims = {"qkv": (32, (32, 16, 16)), "o": (32, (32,)), "gate_up": (32, (48, 48)), "down": (48, (32,))}
    lora_a = [{m: torch.randn(slots, len(wd) * r_max, k, generator=g).to(slot_dtype) for m, (k, wd) in dims.items()}
              for _ in range(layers)]
    lora_b = [{m: torch.randn(slots, r_max, sum(wd), generator=g).to(slot_dtype).transpose(1, 2)
               for m, (k, wd) in dims.items()} for _ in range(layers)]  # rank-major, as the slot buffers hold B
    ranks = torch.tensor([0, rank, r_max], dtype=torch.int32)
    table = DecodeStepLora(lora_a, lora_b, ranks, {m: wd for m, (_, wd) in dims.items()})
    got = table.pack_fold(1)
    parts = []
    for layer in range(layers):
        for m in LORA_MODULES:
            _, wd = dims[m]
            a = lora_a[layer][m][1].view(len(wd), r_max, -1)[:, :rank].reshape(len(wd) * rank, -1)
            parts.append(fold_block(a.float(), lora_b[layer][m][1][:, :rank].float(), wd, rank))
    assert got.dtype == torch.float32 and torch.equal(got, torch.cat(parts))
    with pytest.raises(ValueError, match="holds no adapter"):
        table.pack_fold(0)
