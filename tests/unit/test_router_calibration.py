"""Calibration to a traffic share on synthetic score distributions: the share each model gets under
the thresholds it sets is within a point or so of the one asked for, and hostile values are refused."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.platform.errors import PlatformError
from loraplex.platform.routing.learned import calibration

POOL = {"small": 0.3, "medium": 0.6, "large": 1.0}


@pytest.mark.parametrize("dist", ["beta", "clumped", "uniform"])
@pytest.mark.parametrize("share", [0.05, 0.2, 0.5, 0.9])
def test_the_strong_share_is_met_on_a_synthetic_distribution(dist, share):
    rng = np.random.default_rng(3)
    scores = {"beta": rng.beta(2, 5, 5000), "uniform": rng.random(5000),
              "clumped": np.round(rng.normal(0.55, 0.05, 5000).clip(0, 1), 4)}[dist]  # rounded: ties, as served
    result = calibration.calibrate({"small": 0.3, "large": 1.0}, scores, strong_share=share)
    assert result.thresholds["large"] == 1.0 and result.scores == 5000
    got = float(np.mean(scores > result.thresholds["small"]))  # what `auto` sends past the small model
    assert abs(got - share) <= 0.05 and result.expected["large"] == pytest.approx(got)


def test_shares_per_model_and_the_rest_split_evenly():
    scores = np.random.default_rng(4).beta(2, 2, 4000)
    result = calibration.calibrate(POOL, scores, shares={"small": 0.5, "medium": 0.3, "large": 0.2})
    assert list(result.thresholds) == ["small", "medium", "large"]
    for name, want in {"small": 0.5, "medium": 0.3, "large": 0.2}.items():
        assert abs(result.expected[name] - want) <= 0.01
    even = calibration.calibrate(POOL, scores, strong_share=0.2)
    assert even.shares == {"small": pytest.approx(0.4), "medium": pytest.approx(0.4), "large": 0.2}
    assert abs(even.expected["small"] - 0.4) <= 0.01


def test_all_to_the_strong_or_all_to_the_weak():
    scores = np.linspace(0, 1, 101)
    assert calibration.calibrate(POOL, scores, strong_share=1.0).expected["large"] >= 0.99
    assert calibration.calibrate(POOL, scores, shares={"small": 1.0, "medium": 0, "large": 0}).expected["small"] == 1


@pytest.mark.parametrize("kwargs,error", [
    ({"strong_share": 1.5}, "from 0 to 1"),
    ({"strong_share": float("nan")}, "from 0 to 1"),
    ({"strong_share": None}, "from 0 to 1"),
    ({"shares": {"small": 0.5, "large": 0.5}}, "each model"),
    ({"shares": {"small": 0.9, "medium": 0.9, "large": -0.8}}, "each model"),
])
def test_bad_shares_are_refused(kwargs, error):
    with pytest.raises(PlatformError, match=error):
        calibration.calibrate(POOL, [0.1, 0.2], **kwargs)


def test_an_empty_window_or_a_pool_of_one_is_refused():
    with pytest.raises(PlatformError, match="no `auto` request"):
        calibration.calibrate(POOL, [], strong_share=0.2)
    with pytest.raises(PlatformError, match="at least two models"):
        calibration.calibrate({"large": 1.0}, [0.5], strong_share=0.2)


@pytest.mark.parametrize("raw", ["7d", "24h", "30m", "90s", " 7d "])
def test_windows(raw):
    assert calibration.parse_window(raw).total_seconds() > 0


@pytest.mark.parametrize("raw", ["", "7", "d", "-1d", "0s", "367d", "1e9d", "7w", "9" * 5000])
def test_bad_windows_are_refused(raw):
    with pytest.raises(PlatformError, match="since must be"):
        calibration.parse_window(raw)
