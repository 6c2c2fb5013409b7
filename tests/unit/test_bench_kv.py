"""bench kv's parts: the share of positions alike (after a first difference too) and its option checks."""

import pytest

from loraplex.cli.bench.kv import _dtypes, positions_alike


def test_positions_alike_counts_every_position_of_the_fp32_outputs():
    want = {"0": [1, 2, 3, 4], "1": [5, 6]}
    assert positions_alike({"0": [1, 0, 3, 4], "1": [5]}, want) == round(4 / 6, 4)
    assert positions_alike({}, {}) is None


def test_the_fp32_base_always_runs_first_and_unknown_dtypes_are_named():
    assert _dtypes("int8,fp8,int8") == ["float32", "int8", "fp8"]
    assert _dtypes("float32,bfloat16") == ["float32", "bfloat16"]
    with pytest.raises(ValueError, match=r"--kv-cache-dtypes: int4 \(have: float32, bfloat16, float16, int8, fp8\)"):
        _dtypes("int8,int4")
