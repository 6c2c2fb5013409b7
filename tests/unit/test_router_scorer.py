"""The learned scorer's interface and bounds: deterministic scores (across processes too), bounded
time for any text, explanations, and weights files it refuses."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from loraplex.platform.routing.complexity import RequestText
from loraplex.platform.routing.learned import features
from loraplex.platform.routing.learned.requests import request_text
from loraplex.platform.routing.learned.scorer import HeuristicScorer, LearnedScorer, WeightsError, load_scorer

SHIPPED = LearnedScorer.load()
MATH = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?"


def req(text: str, **fields) -> RequestText:
    return RequestText(text, fields.pop("prompt_chars", len(text)), **fields)


def test_both_scorers_answer_0_to_1_and_the_same_for_the_same_request():
    for scorer in (SHIPPED, HeuristicScorer(), load_scorer("learned"), load_scorer("heuristic")):
        for text in ("Hello", MATH, "x" * 10_000, ""):
            first = scorer.score(req(text, max_tokens=64))
            assert 0.0 <= first <= 1.0 and scorer.score(req(text, max_tokens=64)) == first


def test_the_score_is_the_same_in_another_process():
    """No per-process hash seed: a fresh interpreter (another PYTHONHASHSEED) gives the same score."""
    code = ("import sys, json; from loraplex.platform.routing.learned.scorer import LearnedScorer; "
            "from loraplex.platform.routing.complexity import RequestText; t = sys.argv[1]; "
            "print(json.dumps(LearnedScorer.load().score(RequestText(t, len(t)))))")
    out = subprocess.run([sys.executable, "-c", code, MATH], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin"})
    assert json.loads(out.stdout) == SHIPPED.score(req(MATH))


def test_a_1mb_prompt_is_scored_in_bounded_time_reading_only_both_ends():
    huge = "lorem ipsum dolor " * 60_000  # ~1 MB
    start = time.perf_counter()
    SHIPPED.score(req(huge))
    assert time.perf_counter() - start < 0.5
    # the middle is not read: changing it changes nothing; the ends do (the size features too)
    middle = huge[:500_000] + "QUANTUM " * 10 + huge[500_080:]
    assert SHIPPED.score(req(middle)) == SHIPPED.score(req(huge))
    assert features.scanned(huge) == features.scanned(middle) and len(features.scanned(huge)) == features.SCAN_CHARS
    f = features.featurize(req(huge))
    assert len(f.index) <= 5 * features.SCAN_CHARS  # words, pairs and three n-gram sizes


@pytest.mark.parametrize("text", ["\x00" * 5000, "\U0001F600" * 5000, "\ud800" * 100, "9" * 5000, "a" * 5000,
                                  "\n" * 5000, "A.\nB.\n" * 2000])
def test_hostile_texts_score(text):
    assert 0.0 <= SHIPPED.score(req(text)) <= 1.0


def test_features_carry_conversation_size_and_choices():
    one = features.featurize(request_text({"messages": [{"role": "user", "content": "why?"}]}, None)).dense
    chat = [{"role": "user", "content": "a" * 5000}, {"role": "assistant", "content": "b"}] * 5
    many = features.featurize(request_text({"messages": [*chat, {"role": "user", "content": "why?"}]}, 4096)).dense
    names = features.DENSE_NAMES
    for name in ("log_prompt_chars", "log_turns", "log_max_tokens"):
        assert many[names.index(name)] > one[names.index(name)]
    choice = features.featurize(req("Which?\nA. one\nB. two\nC. three\nAnswer:")).dense
    assert choice[names.index("choices")] == 1 and one[names.index("choices")] == 0


def test_explain_names_what_moved_the_score():
    explained = SHIPPED.explain(req(MATH), top=5)
    assert explained.score == SHIPPED.score(req(MATH)) and len(explained.drivers) == 5
    sizes = [abs(d.contribution) for d in explained.drivers]
    assert sizes == sorted(sizes, reverse=True)
    assert all(d.name in features.DENSE_NAMES or d.name.split(" ")[0] in ("word", "words", "chars")
               or d.name.startswith("word pair") for d in explained.drivers)
    heuristic = HeuristicScorer().explain(req("fix the sql query in my python script"))
    assert heuristic.drivers[0].name == "code"


def test_weights_round_trip_and_bad_files_are_refused(tmp_path):
    path = tmp_path / "w.npz"
    SHIPPED.save(path)
    again = LearnedScorer.load(path)
    assert again.score(req(MATH)) == SHIPPED.score(req(MATH))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(WeightsError, match="not a router weights file"):
        LearnedScorer.load(tmp_path / "junk.npz")
    with pytest.raises(WeightsError, match="not a router weights file"):
        LearnedScorer.load(tmp_path / "missing.npz")
    other = tmp_path / "other.npz"
    with open(other, "wb") as out:
        np.savez(out, weights=np.zeros(16, np.float16), meta=np.array(json.dumps(
            {"format": "loraplex-router/1", "features": "something else"})))
    with pytest.raises(WeightsError, match="train them again"):
        LearnedScorer.load(other)
    with pytest.raises(WeightsError, match="finite"):
        LearnedScorer(np.full(features.WEIGHTS, np.nan), {})
    with pytest.raises(ValueError, match="learned"):
        load_scorer("magic")
