"""bench lora's agreement of greedy outputs (bf16 slots against fp32 ones): whole requests alike, and
the share of tokens before each request's first difference."""

from loraplex.cli.bench.lora import agreement


def test_agreement_counts_identical_requests_and_tokens_before_the_first_difference():
    want = {"0": [1, 2, 3, 4], "1": [5, 6, 7, 8], "2": [9, 9, 9, 9]}
    got = {"0": [1, 2, 3, 4], "1": [5, 6, 0, 8], "2": [0, 9, 9, 9]}
    # request 0 all 4 alike; request 1 differs at its third token (2 before); request 2 at its first
    assert agreement(got, want) == {"requests_as_fp32": 1, "requests": 3, "tokens_before_difference": 0.5}


def test_a_missing_or_short_output_counts_only_what_it_matched():
    want = {"0": [1, 2, 3], "1": [4, 5]}
    assert agreement({"0": [1, 2]}, want) == {"requests_as_fp32": 0, "requests": 2, "tokens_before_difference": 0.4}
    assert agreement({}, {})["tokens_before_difference"] is None
