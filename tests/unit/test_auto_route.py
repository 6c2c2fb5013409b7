"""`auto` routing's pure parts: the complexity score (its documented examples and each signal) and
the choice among models (fit, capability, cost, currencies, fallbacks)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from loraplex.billing.prices import Price
from loraplex.platform.routing.auto import Candidate, choose, request_text
from loraplex.platform.routing.complexity import WEIGHTS, RequestText, score

REVIEW = ("Review this code and explain why it fails, compare two fixes and justify the trade-off:\n"
          "```python\ndef f(x):\n    return x[0]\n```\n1. What is the bug?\n2. How would you test it?\n"
          "3. Which fix is safer?\n4. What about performance?")


def asked(text: str, **fields) -> float:
    return score(RequestText(text, fields.pop("prompt_chars", len(text)), **fields)).score


@pytest.mark.parametrize("text,expected", [
    ("Hello", 0.0),
    ("What is the capital of France?", 0.0),
    ("Write a Python function that parses dates", 0.1667),
    (r"Prove step by step that $\sum_{i=1}^n i = n(n+1)/2$ by induction.", 0.3667),
    (REVIEW, 0.65),
])
def test_the_documented_examples(text, expected):
    assert asked(text) == expected


def test_a_long_conversation_asking_for_much_output_scores_near_one():
    assert asked(REVIEW, prompt_chars=len(REVIEW) + 12_000, turns=6, max_tokens=2048) == 0.9543


def signals(text: str, **fields) -> dict[str, float]:
    return score(RequestText(text, fields.pop("prompt_chars", len(text)), **fields)).signals


def test_length_output_and_dialogue_ramp_between_their_bounds():
    assert signals("x", prompt_chars=400)["length"] == 0 and signals("x", prompt_chars=32_000)["length"] == 1
    mid = signals("x", prompt_chars=4000)["length"]
    assert 0.4 < mid < 0.6  # log-scaled: 4000 is about halfway from 400 to 32,000
    assert signals("x", max_tokens=None)["output"] == 0 and signals("x", max_tokens=128)["output"] == 0
    assert signals("x", max_tokens=4096)["output"] == 1 and signals("x", max_tokens=100_000)["output"] == 1
    assert signals("x", turns=4)["dialogue"] == 0 and signals("x", turns=16)["dialogue"] == 1


def test_code_math_reasoning_and_multipart_signals():
    assert signals("```\nls -la\n```")["code"] == 1
    assert signals("x = 1;\ny = 2;\nz = x + y;")["code"] == 1  # three code-like lines
    assert signals("fix the sql query in my python script")["code"] == 1
    assert signals("fix the bug")["code"] == pytest.approx(1 / 3)
    assert signals(r"what is \frac{1}{2}?")["math"] == 1 and signals("solve x = 3y + 2")["math"] == 1
    assert signals("is 7 a prime")["math"] == pytest.approx(1 / 3)
    assert signals("explain why, step by step, and compare")["reasoning"] == 1
    assert signals("one? two? three? four? five?")["multipart"] == 1
    assert signals("- apples\n- pears\n- plums")["multipart"] == 0.5
    assert signals("just one question?")["multipart"] == 0


def test_terms_count_as_whole_words_only():
    """"classic", "planet" and "debugger" hold "class", "plan" and "debug" but ask for neither."""
    assert signals("a classic planet story about a debugger") == signals("a story")
    assert signals("plan the class")["reasoning"] > 0 and signals("plan the class")["code"] > 0


def test_the_score_is_the_weighted_sum_capped_at_one():
    c = score(RequestText(REVIEW, 40_000, 20, 8192))
    assert all(0 <= v <= 1 for v in c.signals.values()) and set(c.signals) == set(WEIGHTS)
    assert sum(WEIGHTS[k] * v for k, v in c.signals.items()) > 1 and c.score == 1.0
    assert asked("explain why it fails") < asked("explain why it fails, step by step") < asked(
        "explain why it fails, step by step, in this python function")


def test_a_huge_turn_is_read_at_both_ends_only():
    filler = "lorem ipsum " * 200_000  # 2.4 MB
    for text in (f"Prove step by step: {filler}", f"{filler} Prove step by step"):
        assert signals(text)["reasoning"] == pytest.approx(2 / 3) and signals(text)["length"] == 1
    assert signals(f"{filler[:1_000_000]} prove {filler[:1_000_000]}")["reasoning"] == 0  # the middle is skipped


def test_request_text_reads_chat_completion_and_token_prompts():
    chat = {"messages": ({"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
                         {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second ask"})}
    assert request_text(chat, 64) == RequestText("second ask", 8 + 5 + 2 + 10, 3, 64)
    assert request_text({"prompt": "complete me"}, None) == RequestText("complete me", 11, 1, None)
    assert request_text({"prompt_token_ids": (1, 2, 3)}, 5) == RequestText("", 12, 1, 5)


NOW = datetime(2026, 1, 1, tzinfo=UTC)


def price(model: str, input_micros: int, output_micros: int, currency: str = "USD") -> Price:
    return Price(1, model, currency, input_micros, 0, output_micros, NOW)


def cand(name: str, max_complexity: float, *, context: int = 1000, prompt: int = 100, p: Price | None = None):
    return Candidate(name, max_complexity, context, prompt, p)


SMALL = cand("small", 0.3, p=price("small", 100_000, 200_000))
MEDIUM = cand("medium", 0.6, p=price("medium", 500_000, 1_000_000))
LARGE = cand("large", 1.0, p=price("large", 3_000_000, 6_000_000))


def test_the_cheapest_model_that_can_take_the_request():
    pool = [LARGE, MEDIUM, SMALL]
    assert choose(pool, 0.0, None, 100).name == "small"
    assert choose(pool, 0.3, None, 100).name == "small"  # the limit is inclusive
    assert choose(pool, 0.31, None, 100).name == "medium"
    assert choose(pool, 0.9, None, 100).name == "large"


def test_cost_not_rank_decides_among_the_able():
    """A capable model priced below a weaker one takes the easy requests too."""
    cheap_large = cand("large", 1.0, p=price("large", 10_000, 10_000))
    assert choose([SMALL, cheap_large], 0.1, None, 100).name == "large"
    # "out" is cheaper on the prompt, "in" once the request may generate 1000 tokens.
    in_heavy = cand("in", 1.0, p=price("in", 1_000_000, 100_000))
    out_heavy = cand("out", 1.0, p=price("out", 100_000, 1_000_000))
    assert choose([in_heavy, out_heavy], 0.1, None, 0).name == "out"
    assert choose([in_heavy, out_heavy], 0.1, None, 1000).name == "in"


def test_unpriced_models_cost_nothing_and_ties_go_to_the_smaller_rank():
    free_small, free_large = cand("b-small", 0.3), cand("a-large", 1.0)
    assert choose([free_large, free_small], 0.1, None, 100).name == "b-small"
    assert choose([LARGE, free_large], 0.5, None, 100).name == "a-large"  # free beats priced
    twin = cand("twin", 0.3, p=price("twin", 100_000, 200_000))
    assert choose([twin, SMALL], 0.1, None, 100).name == "small"  # same cost and rank: by name


def test_prices_in_different_currencies_are_not_compared():
    eur_large = cand("large", 1.0, p=price("large", 1, 1, "EUR"))
    assert choose([eur_large, SMALL], 0.1, None, 100).name == "small"


def test_a_model_whose_context_cannot_hold_the_request_is_passed_over():
    short = cand("short", 0.5, context=150, prompt=100)
    long = cand("long", 1.0, context=4000, prompt=100, p=price("long", 9_000_000, 9_000_000))
    assert choose([short, long], 0.1, 50, 50).name == "short"
    assert choose([short, long], 0.1, 51, 51).name == "long"  # 100 + 51 > 150
    assert choose([short, long], 0.1, None, 0).name == "short"  # no max_tokens: one token must fit
    over = cand("short", 0.5, context=150, prompt=150)
    assert choose([over, long], 0.1, None, 0).name == "long"


def test_too_complex_for_all_goes_to_the_most_capable_that_fits():
    assert choose([SMALL, MEDIUM], 0.9, None, 100).name == "medium"
    short_large = cand("large", 1.0, context=120, prompt=100)
    assert choose([SMALL, MEDIUM, short_large], 0.9, 50, 50).name == "medium"


def test_nothing_fits_goes_to_the_longest_context_for_its_error():
    a, b = cand("a", 1.0, context=200, prompt=500), cand("b", 0.2, context=400, prompt=500)
    assert choose([a, b], 0.5, None, 0).name == "b"
