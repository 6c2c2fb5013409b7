"""Draft tokens for speculative decoding by n-gram lookup in the request's own tokens (prompt lookup).

Outputs often repeat their input (code edits, extraction, summaries that quote) or themselves: the
tokens that followed the last earlier occurrence of the sequence's final n tokens are a cheap guess
at what comes next. The engine verifies a guess in one forward pass over its tokens, which on a
memory-bound decode costs about what one token does, and keeps the prefix the model agrees with.

The search runs in C: tokens as 4-byte little-endian words, `bytes.rfind` for the pattern, kept
only at word boundaries.
"""

from __future__ import annotations

from array import array

MAX_NGRAM = 4  # the longest suffix looked up first: a longer match is a better guess
MIN_NGRAM = 2  # one token alone matches too much to be worth a verification


def propose(tokens: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the last earlier occurrence of the longest suffix of `tokens` (of
    MAX_NGRAM down to MIN_NGRAM tokens) found earlier in them; [] when none is."""
    if k < 1 or len(tokens) <= MIN_NGRAM:
        return []
    words = array("i", tokens).tobytes()
    end = len(words)
    for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
        pattern = words[end - 4 * n:]
        limit = end - 4  # an occurrence must end before the suffix does
        while (at := words.rfind(pattern, 0, limit)) >= 0:
            if at % 4 == 0:
                start = at // 4 + n
                return tokens[start:start + k]
            limit = at + len(pattern) - 1
    return []
