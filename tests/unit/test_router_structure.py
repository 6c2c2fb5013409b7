"""The learned scorer's structure signals (steps of a word problem, a question's options), its
per-kind target centring and its standardized fit: what they read, that they stay bounded on hostile
text, and that the fit's folding back to raw weights scores as the standardized model does."""

from __future__ import annotations

import time

import numpy as np
import pytest

from loraplex.platform.routing.complexity import RequestText
from loraplex.platform.routing.learned import features, linear, structure, training
from loraplex.platform.routing.learned.scorer import LearnedScorer

SHIPPED = LearnedScorer.load()
SHORT = "Tom has 3 apples. How many apples does he have?"
STEPS = ("Tom buys 12 boxes of 24 pencils each at $1.50 per box. He gives half of the pencils to Ann and "
         "a third of the rest to Bo. After 3 weeks, 15% of what is left breaks. How many pencils remain?")


def signal(text: str, name: str, choices: bool = False) -> float:
    return float(structure.signals(text, choices)[structure.NAMES.index(name)])


def test_word_problem_signals_count_the_steps():
    for name in ("open_numbers", "open_distinct_numbers", "open_relations", "open_fractions", "open_percent",
                 "open_money", "open_decimals", "open_time_units", "open_number_sentences"):
        assert signal(STEPS, name) > signal(SHORT, name), name
    assert signal(STEPS, "question_chars") == 0  # an open request's choice block stays zero


def test_choice_signals_read_the_question_apart_from_its_options():
    compound = ("For which of these two scenarios does the main character do something wrong? Scenario 1 | I lied. "
                "Scenario 2 | I paid.\nA. Wrong, Wrong\nB. Wrong, Not wrong\nC. Not wrong, Wrong\nD. Not wrong, Not "
                "wrong\nAnswer:")
    plain = "What is the capital of France?\nA. Paris\nB. Lyon\nC. Nice\nD. Lille\nAnswer:"
    negated = "Which of the following is NOT a prime?\nA. 2\nB. 3\nC. 9\nD. 5\nAnswer:"
    assert signal(compound, "options_overlap", True) > 0.9 > 0.1 > signal(plain, "options_overlap", True)
    assert signal(compound, "numbered_statements", True) > 0 == signal(plain, "numbered_statements", True)
    assert signal(negated, "question_negation", True) > 0 == signal(plain, "question_negation", True)
    assert signal(negated, "options_numeric", True) == 1 and signal(plain, "options_numeric", True) == 0
    assert signal(negated, "question_which_following", True) == 1
    assert signal(plain, "options", True) == pytest.approx(np.log1p(4) / np.log1p(10))
    assert signal(plain, "open_numbers", True) == 0


@pytest.mark.parametrize("unit", ["A.\nB.\n", "1,2 ", "$1.5% ", "Scenario 1 II. ", "each per total ", "a. b\n",
                                  "\U0001F600", "\ud800", "9", "Tom. "])
def test_hostile_megabyte_turns_score_in_bounded_time_and_the_same_twice(unit):
    text = unit * (1_000_000 // len(unit))
    request = RequestText(text, len(text))
    start = time.perf_counter()
    first = SHIPPED.score(request)
    assert time.perf_counter() - start < 0.5
    assert 0.0 <= first <= 1.0 and SHIPPED.score(request) == first
    dense = features.featurize(request).dense
    assert dense.shape == (features.DENSE,) and np.all((dense >= 0) & (dense <= 1))


def test_targets_are_centred_within_each_kind_of_request():
    lines = [("Q?\nA. x\nB. y\nAnswer:", True, True), ("Q?\nA. x\nB. y\nAnswer:", False, True),
             ("Q?\nA. x\nB. y\nAnswer:", False, True), ("open one", True, False), ("open two", True, True)]
    examples = [training.Example(RequestText(t, len(t)), weak, strong) for t, weak, strong in lines]
    batch = training.batch_of(examples)
    target = training.centred_targets(batch, examples, np.ones(len(examples)))
    assert target[:3].mean() == pytest.approx(0.5) and target[3:].mean() == pytest.approx(0.5)
    assert target[1] - target[0] == pytest.approx(0.5) and target[4] - target[3] == pytest.approx(0.5)


def test_the_standardized_fit_scores_raw_features_and_ignores_a_feature_scale():
    rng = np.random.default_rng(3)
    dense = np.zeros((200, features.DENSE), np.float32)
    dense[:, :3] = rng.random((200, 3)) * np.float32([1.0, 0.01, 0.5])  # one feature a hundred times narrower
    dense[:, 5] = 0.25  # constant: no weight
    dense[:, -1] = 1.0
    target = (dense[:, 1] / 0.01 > 0.5).astype(float)  # the narrow feature decides
    batch = linear.Batch(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), dense)
    weights = linear.fit(batch, target, l2=1e-3, steps=300, lr=0.1)
    assert weights[5] == 0 and np.all(np.isfinite(weights))
    logits = linear.logits(weights.astype(np.float64), batch)
    assert np.mean((logits > 0) == (target > 0.5)) > 0.95
