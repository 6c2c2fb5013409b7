"""copy_blocks.c (an adapter's slot write) against plain tensor slicing: copies, scaled copies, copies
of a transposed source and zero fills of strided blocks, in one call, and refusal of malformed entries
before anything is written."""

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


@pytest.mark.parametrize("scale", [1.0, 0.5, -3.0])
@pytest.mark.parametrize("count", [1, 40, 400])  # 400 big blocks run on several threads
def test_blocks_copy_scale_and_zero(scale, count):
    gen = torch.Generator().manual_seed(count)
    dst = torch.randn(count, 12, 40, generator=gen)
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
            expected[i, r0:r0 + rows, c0:c0 + cols] = scale * part.t()
        else:  # rows of src [9, 33] (row stride 33) from column 1
            part = src[i, :rows, 1:1 + cols]
            entries.append(block(part.data_ptr(), out.data_ptr(), rows, cols, 33, 40, scale))
            expected[i, r0:r0 + rows, c0:c0 + cols] = scale * part
    copy_blocks(torch.tensor(entries, dtype=torch.int64))
    assert torch.equal(dst, expected)  # fp32 products rounded as torch rounds them; nothing else touched


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
