"""Training and evaluating the learned scorer: RouteLLM's measures on known orders, a clearly
separable toy set the tests write (held-out APGR near the oracle's), labelled-file errors, and the
`router train` / `bench router` commands on it."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from loraplex.cli.main import main
from loraplex.platform.routing.learned import evaluation, metrics, training
from loraplex.platform.routing.learned.requests import BadLine
from loraplex.platform.routing.learned.scorer import LearnedScorer

WEAK = np.array([1, 0, 1, 0, 1, 1, 0, 1], float)
STRONG = np.array([1, 1, 1, 1, 0, 1, 1, 1], float)


def test_apgr_of_the_oracle_the_reverse_and_a_constant():
    gain = STRONG - WEAK
    oracle, reverse = metrics.apgr(gain, WEAK, STRONG), metrics.apgr(-gain, WEAK, STRONG)
    assert oracle > 0.7 > 0.3 > reverse
    assert metrics.apgr(np.zeros(8), WEAK, STRONG) == pytest.approx(0.5, abs=0.07)  # ties: the expected order
    curve = metrics.gap_curve(np.zeros(8), WEAK, STRONG)
    assert curve[0] == 0 and curve[-1] == pytest.approx(1.0) and np.allclose(np.diff(curve), curve[1])
    # the 3 prompts only the strong model gets right come first; the gap is 3 - 1 = 2 (one prompt only the weak
    # model gets right): half of it after one strong call, all after two, 3/2 of it after three
    assert metrics.share_to_recover(gain, WEAK, STRONG, 0.5) == pytest.approx(1 / 8)
    assert metrics.share_to_recover(gain, WEAK, STRONG, 1.0) == pytest.approx(2 / 8)
    assert metrics.gap_curve(gain, WEAK, STRONG)[3] == pytest.approx(1.5)


def test_bootstrap_intervals_hold_the_point_figure():
    rng = np.random.default_rng(1)
    weak, strong = rng.random(300) < 0.6, rng.random(300) < 0.8
    scores = strong.astype(float) - weak + rng.normal(0, 1, 300)
    point = metrics.summary(scores, weak, strong)
    for name, (low, high) in metrics.bootstrap(scores, weak, strong, rounds=100).items():
        assert low <= point[name] <= high and low < high


def toy_lines(per_domain: int = 40) -> list[dict]:
    """Six subjects; in each, a fifth of the prompts need the strong model, and they say so in words
    no subject owns ("tricky multi-step"), at the same lengths as the others."""
    rng = np.random.default_rng(7)
    lines = []
    for d, subject in enumerate(["botany", "law", "music", "optics", "poetry", "tax"]):
        for i in range(per_domain):
            hard = i % 5 == 0
            ask = "a tricky multi-step puzzle needing care" if hard else "a plain quick lookup of one simple fact"
            filler = " ".join(f"{subject}{rng.integers(0, 50)}" for _ in range(rng.integers(3, 12)))
            lines.append({"set": "toy", "domain": subject, "prompt": f"{filler} : {ask} #{d}-{i}",
                          "weak_correct": not hard, "strong_correct": True})
    return lines


def examples(lines: list[dict]) -> list[training.Example]:
    return training.read_examples(io.BytesIO("\n".join(json.dumps(x) for x in lines).encode()))


def test_a_separable_toy_set_is_learned_on_held_out_subjects():
    toy = examples(toy_lines())
    folds = evaluation.folds(toy, 3)
    for subject in {e.domain for e in toy}:  # each subject sits in one fold
        assert len({f for f, e in zip(folds, toy, strict=True) if e.domain == subject}) == 1
    report = evaluation.report(toy, k=3, rounds=50)["sets"]["all"]["routers"]
    weak = np.array([e.weak_correct for e in toy], float)
    strong = np.array([e.strong_correct for e in toy], float)
    oracle = metrics.apgr(strong - weak, weak, strong)
    assert report["learned"]["apgr"]["value"] >= 0.97 * oracle
    assert report["learned"]["apgr"]["value"] > report["length"]["apgr"]["value"] + 0.2
    assert report["random"]["apgr"]["value"] == pytest.approx(0.5, abs=0.1)
    assert report["learned"]["strong_share_for_80pct"]["value"] <= 0.2


def test_a_set_with_one_domain_is_split_by_problem():
    toy = examples([{**x, "domain": "one"} for x in toy_lines(10)])
    assert len(set(evaluation.folds(toy, 5))) == 5


@pytest.mark.parametrize("line,error", [
    ('{"prompt": "x", "weak_correct": 1, "strong_correct": true}', "must be true or false"),
    ('{"weak_correct": true, "strong_correct": true}', "needs a string 'prompt' or 'messages'"),
    ('{"prompt": "x", "weak_correct": true, "strong_correct": true, "domain": 5}', "set and domain"),
    ('[1, 2]', "not a JSON object"),
    ('{"prompt": ', "not JSON"),
])
def test_bad_labelled_lines_name_the_line(line, error):
    good = '{"prompt": "fine", "weak_correct": true, "strong_correct": true}'
    with pytest.raises(BadLine, match=f"line 2: .*{error}"):
        training.read_examples(io.BytesIO(f"{good}\n{line}\n".encode()))


def test_router_train_and_bench_router_commands(tmp_path, capsys):
    data = tmp_path / "toy.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in toy_lines()) + "\n")
    weights = tmp_path / "out" / "router.npz"
    assert main(["router", "train", "--data", str(data), "--out", str(weights)]) == 0
    scorer = LearnedScorer.load(weights)
    hard = scorer.score(training.RequestText("violin : a tricky multi-step puzzle needing care", 50))
    easy = scorer.score(training.RequestText("violin : a plain quick lookup of one simple fact", 50))
    assert hard > easy and scorer.meta["examples"] == 240
    out = tmp_path / "bench.json"
    assert main(["bench", "router", "--data", str(data), "--json", str(out), "--folds", "3", "--bootstrap", "20",
                 "--weights", str(weights)]) == 0
    results = json.loads(out.read_text())
    assert results["sets"]["all"]["routers"]["learned"]["apgr"]["value"] > 0.8
    assert results["scorer_latency"]["requests"] == 3 * 240
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    capsys.readouterr()
    assert main(["router", "train", "--data", str(bad), "--out", str(weights)]) == 2
    assert capsys.readouterr().err.strip() == "loraplex: error: line 1: weak_correct and strong_correct must be true " \
                                              "or false"


def test_serve_refuses_bad_router_weights_before_it_loads_a_model(tmp_path, capsys):
    assert main(["serve", "--router-weights", str(tmp_path / "missing.npz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex: error: ") and "not a router weights file" in err and err.count("\n") == 1
