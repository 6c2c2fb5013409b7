"""argmax.c (greedy sampling's pick) against torch.argmax: random rows of every length around the
vector widths, ties, NaN, infinities, signed zeros, row views of a wider tensor, and batches big enough
to share the rows between threads."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu.argmax import argmax_available, argmax_rows

pytestmark = pytest.mark.skipif(not argmax_available(), reason="the CPU kernels are not built")


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 49152])
@pytest.mark.parametrize("rows", [1, 3, 32])  # 32 x 49152 runs on several threads
def test_random_rows_match_torch(rows, n):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows * 1000 + n))
    assert torch.equal(argmax_rows(x), x.argmax(-1))


@pytest.mark.parametrize("n", [5, 16, 40, 1000])
def test_ties_go_to_the_first_index(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-3, 3, (64, n), generator=gen).float()  # many equal maxima per row
    x[0] = 7.0  # a row that is all one value
    x[1, n // 2:] = 9.0  # the max first appears mid-row, then repeats to the end
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(x)[0] == 0 and argmax_rows(x)[1] == n // 2


@pytest.mark.parametrize("n", [3, 16, 37, 4096])
def test_nan_counts_above_every_number_as_in_torch(n):
    x = torch.randn(6, n, generator=torch.Generator().manual_seed(n))
    x[0, n - 1] = float("nan")             # a NaN at the end, past a larger number
    x[1, n // 3] = float("inf")
    x[1, n - 1] = float("nan")             # after +inf: the NaN still wins
    x[2, :] = float("nan")                 # all NaN: index 0
    x[3, 1:] = float("nan")                # the first NaN at 1
    x[4] = float("-inf")                   # all -inf: index 0
    x[5, n // 2] = float("inf")            # +inf, no NaN
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(x).tolist()[:5] == [n - 1, n - 1, 0, 1, 0]


def test_negative_and_positive_zero_are_equal():
    x = torch.tensor([[-0.0, 0.0, -1.0] * 11, [-5.0] * 21 + [0.0, -0.0] * 6])
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_row_views_of_a_wider_tensor():
    wide = torch.randn(8, 300, generator=torch.Generator().manual_seed(3))
    x = wide[:, 10:265]  # rows 300 floats apart, 255 long
    assert not x.is_contiguous()
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(wide[:0]).shape == (0,)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="row-dense 2-d"):
        argmax_rows(torch.randn(4, 8).t())  # columns, not rows, are dense
    with pytest.raises(ValueError, match="float32"):
        argmax_rows(torch.randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="empty row"):
        argmax_rows(torch.randn(4, 0))
