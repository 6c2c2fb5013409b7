"""copy_blocks.c (an adapter's slot write) against plain tensor slicing: copies, scaled copies, copies
of a transposed source and zero fills of strided blocks, in one call, into fp32, bf16 and fp16 buffers
(rounded as torch's .to() rounds), and refusal of malformed entries before anything is written."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu.copy_blocks import (
    block,
    copy_blocks,
    copy_blocks_available,
    scale_bits,
    scale_bits_column,
)


def test_copy_blocks_builds():
    assert copy_blocks_available()


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])


@DTYPES
@pytest.mark.parametrize("scale", [1.0, 0.5, -3.0, 0.1])
@pytest.mark.parametrize("count", [1, 40, 400])  # 400 big blocks run on several threads
def test_blocks_copy_scale_and_zero(scale, count, dtype):
    gen = torch.Generator().manual_seed(count)
    dst = torch.randn(count, 12, 40, generator=gen).to(dtype)
    src = torch.randn(count, 9, 33, generator=gen)
    expected = dst.clone()
    entries = []
    for i in range(count):
        rows, cols, r0, c0 = 3 + i % 7, 5 + i % 27, i % 3, i % 5
        out = dst[i, r0:r0 + rows, c0:c0 + cols]
        if i % 4 == 3:  # a zero fill
            entries.append(block(0, out.data_ptr(), rows, cols, 0, 40, 0.0))
            expected[i, r0:r0 + rows, c0:c0 + cols] = 0
        elif i % 4 == 2 and cols <= 9:  # src [9, 33] read transposed: dst row r = src column r (a PEFT B)
            part = src[i, :cols, 2:2 + rows]  # [cols, rows], row stride 33
            entries.append(block(part.data_ptr(), out.data_ptr(), rows, cols, 1, 40, scale, src_cs=33))
            expected[i, r0:r0 + rows, c0:c0 + cols] = (scale * part.t()).to(dtype)
        else:  # rows of src [9, 33] (row stride 33) from column 1
            part = src[i, :rows, 1:1 + cols]
            entries.append(block(part.data_ptr(), out.data_ptr(), rows, cols, 33, 40, scale))
            expected[i, r0:r0 + rows, c0:c0 + cols] = (scale * part).to(dtype)
    copy_blocks(torch.tensor(entries, dtype=torch.int64), dtype)
    # fp32 products, rounded once as torch rounds them; nothing else touched
    assert torch.equal(dst.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                       expected.view(torch.int16 if dtype.itemsize == 2 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_16_bit_rounding_matches_torch_at_its_edges(dtype):
    """Ties to even, subnormals, the smallest and largest values, overflow to inf, signed zeros: each
    bit pattern as torch's .to(dtype) gives it, through the vector stores (whole rows of 8) and the
    scalar ones (a tail of 5), dense and transposed."""
    info = torch.finfo(dtype)
    fp32 = torch.tensor([0.0, -0.0, 1.0, -2.5, info.max, -info.max, info.tiny, info.tiny / 3, info.tiny * 0.75,
                         65519.0, 65520.0, 1e30, -1e30, 1e-30, 2.0 ** -25, 2.0 ** -25 * 1.0001, 3 * 2.0 ** -25,
                         1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                         float("inf"), float("-inf"), 0.1, 1 / 3, 7.0e-6, -6.1e-5])
    gen, more = torch.Generator().manual_seed(3), 45 - fp32.numel()
    spread = torch.randn(more, generator=gen) * 10.0 ** torch.randint(-9, 5, (more,), generator=gen)
    src = torch.cat([fp32, spread]).reshape(3, 15).contiguous()  # rows of 15: one vector of 8 and a tail of 7
    want = src.to(dtype).view(torch.int16)
    dst = torch.zeros(3, 15, dtype=dtype)
    copy_blocks(torch.tensor([block(src.data_ptr(), dst.data_ptr(), 3, 15, 15, 15, 1.0)]), dtype)
    dense = dst.view(torch.int16).clone()
    square = torch.cat([src.reshape(-1), src.reshape(-1)[:19]]).reshape(8, 8).contiguous()  # 8x8 register tiles
    tdst = torch.zeros(8, 8, dtype=dtype)
    copy_blocks(torch.tensor([block(square.data_ptr(), tdst.data_ptr(), 8, 8, 1, 8, 1.0, src_cs=8)]), dtype)
    assert torch.equal(dense, want)
    assert torch.equal(tdst.view(torch.int16), square.t().to(dtype).view(torch.int16))


@pytest.mark.parametrize("rank", [16, 5])  # whole 8x8 register tiles (and a last one overlapping), or none
def test_a_transposed_source_wider_than_one_pass(rank):
    """More columns than one pass of the strided copy takes (64), as a gate_up B of 3072 outputs."""
    src = torch.randn(150, rank)  # PEFT's B [out, rank]
    dst = torch.zeros(20, 160)  # rank-major rows, 160 floats apart
    copy_blocks(torch.tensor([block(src.data_ptr(), dst[2].data_ptr(), rank, 150, 1, 160, 0.25, src_cs=rank)]))
    expected = torch.zeros(20, 160)
    expected[2:2 + rank, :150] = 0.25 * src.t()
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("bad", [dict(rows=-1), dict(cols=-2), dict(dst_ld=3), dict(src_ld=3), dict(src_cs=0)])
def test_malformed_entries_refused_before_any_write(bad):
    src, dst = torch.ones(4, 8), torch.zeros(4, 8)
    fields = dict(rows=4, cols=8, src_ld=8, dst_ld=8, src_cs=1) | bad
    good = block(src.data_ptr(), dst.data_ptr(), 4, 8, 8, 8, 1.0)
    with pytest.raises(ValueError, match="negative sizes, a column stride below 1 or a row stride"):
        copy_blocks(torch.tensor([good, block(src.data_ptr(), dst.data_ptr(), fields["rows"], fields["cols"],
                                              fields["src_ld"], fields["dst_ld"], 1.0, fields["src_cs"])]))
    assert not dst.any()


def test_a_table_of_the_wrong_shape_or_type_is_refused():
    good = block(0, 0, 0, 0, 0, 0, 0.0)
    for table in (torch.tensor([good], dtype=torch.int32), torch.tensor([good[:6]]), torch.tensor(good)):
        with pytest.raises(ValueError, match="int64 CPU tensor"):
            copy_blocks(table)


def test_a_scale_column_holds_each_scales_bits():
    scales = [1.0, 0.0, 2.0 / 3.0, -1.5, 16 / 12]
    assert scale_bits_column(torch.tensor(scales, dtype=torch.float64)).tolist() == [scale_bits(s) for s in scales]
