"""The paired ratio of interleaved bench rounds: each round's ratio, then their median."""

import math

from loraplex.cli.bench.engine import paired_ratio


def test_paired_ratio_is_the_median_of_same_round_ratios():
    # base's best round (500) met a fast phase the other run never did: best over best says 0.8,
    # while in every round the run kept 0.9 or more of base's speed
    figures = {"base": [300.0, 500.0, 400.0], "lora": [291.0, 400.0, 380.0]}
    assert max(figures["lora"]) / max(figures["base"]) == 0.8
    assert paired_ratio(figures, "lora", "base") == 0.95  # rounds: 0.97, 0.8, 0.95


def test_paired_ratio_skips_empty_base_rounds_and_has_no_value_without_any():
    assert paired_ratio({"base": [0.0, 200.0], "x": [5.0, 100.0]}, "x", "base") == 0.5
    assert math.isnan(paired_ratio({"base": [0.0], "x": [1.0]}, "x", "base"))
