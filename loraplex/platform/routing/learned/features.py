"""A request as dense (and optionally hashed) features, in bounded time: what the learned scorer reads.

- Text: the last user turn, at most SCAN_CHARS of it (its first and last SCAN_CHARS / 2 when
  longer), lower-cased, digits folded to "0" so numbers of the same shape share features.
- Hashed features (HASH_BITS buckets), those of the namespaces in HASHED: words ("w"), word pairs
  ("p"), and character 3-, 4- and 5-grams ("c3".."c5"). None ship on: next to the structure signals
  below, hashed words (or words, pairs and character n-grams) ranked held-out subjects no better
  at any penalty tried, and worse at light ones (docs/routing.md); without them the weights are
  DENSE numbers. Each is a 64-bit polynomial hash of its characters computed with numpy over
  prefix sums (no Python loop per n-gram and no per-process hash seed: the same text gives the same
  buckets in every process).
  Each namespace's occurrences weigh 1 / sqrt(its count), so a long prompt is not a loud one.
- Dense features (the first DENSE slots): sizes on log scales (conversation, last turn, words,
  lines, numbers, turns, max_tokens), each twice: for open requests and for multiple-choice ones
  (lines "A." "B." ...), whose sizes mean other things; and structure.py's signals of the work the
  prompt asks for (steps of a word problem; a question's options), read over STRUCTURE_CHARS.
  complexity.py's hand-set signals are not features (they ranked worse on held-out data): they stay
  the explainable fallback scorer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from loraplex.platform.routing.complexity import RequestText
from loraplex.platform.routing.learned import structure

SCAN_CHARS = 2_048
STRUCTURE_CHARS = 2_048  # what structure.py's regexes read of the scanned text
SHARE_FLOOR = 200  # digit and upper-case shares are of at least this many characters
HASH_BITS = 18
NGRAMS = (3, 4, 5)
HASHED: tuple[str, ...] = ()  # the namespaces hashed: any of "w", "p", "c3", "c4", "c5"
_P = 0x100000001B3  # odd: invertible mod 2**64
_Q = pow(_P, -1, 1 << 64)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_PAIR = np.uint64(0xC2B2AE3D27D4EB4F)


def _powers(base: int, n: int) -> np.ndarray:
    """[n] uint64: base**i mod 2**64."""
    out = np.empty(n, dtype=np.uint64)
    acc = 1
    for i in range(n):
        out[i] = acc
        acc = (acc * base) & 0xFFFFFFFFFFFFFFFF
    return out


_PP = _powers(_P, SCAN_CHARS + 2)
_QQ = _powers(_Q, SCAN_CHARS + 2)
_SIZE_NAMES = ("log_prompt_chars", "log_turn_chars", "log_words", "log_lines", "log_numbers", "log_turns",
               "log_max_tokens", "question_marks", "digit_share", "upper_share")
# each size twice: for open requests and for multiple-choice ones (lines "A." "B." ...), whose sizes mean
# other things (a long MMLU question is a long passage; a long open one, many steps)
DENSE_NAMES = (*_SIZE_NAMES, *(f"choices:{n}" for n in _SIZE_NAMES), *structure.NAMES, "choices", "bias")
DENSE = len(DENSE_NAMES)
WEIGHTS = (1 << HASH_BITS) if HASHED else DENSE  # the weight vector: dense slots first, then the buckets
KIND_NAMES = {"w": "word", "p": "word pair", **{f"c{n}": "chars" for n in NGRAMS}}
# what a weights file must have been trained on: changing any feature changes this
VERSION = (f"{'+'.join(HASHED) or 'nohash'}/bits{HASH_BITS if HASHED else 0}/scan{SCAN_CHARS}+{STRUCTURE_CHARS}"
           f"/dense{len(DENSE_NAMES)}/share{SHARE_FLOOR}/v3")
_CHOICE = re.compile(r"^[ \t]*+\(?[A-Ha-h][.)][ \t]", re.MULTILINE)  # a line opening with "A." or "(b)"
# namespace seeds: words, word pairs, char n-grams by n
_SEEDS = {"w": np.uint64(0x51ED27), "p": np.uint64(0xA11CE5), **{f"c{n}": np.uint64(0xC0FFEE + n) for n in NGRAMS}}


@dataclass(frozen=True)
class Features:
    """One request's features: `dense` [DENSE] float32, `index` [K] int64 buckets of HASH_BITS,
    `value` [K] float32 (their weights), `kind` [K] the namespace of each (for explanations)."""

    dense: np.ndarray
    index: np.ndarray
    value: np.ndarray
    spans: dict[str, np.ndarray]  # namespace -> [K_ns, 2] character spans in `text` (for explanations)
    text: str


def scanned(text: str, bound: int = SCAN_CHARS) -> str:
    """The first and last bound / 2 characters of a longer turn: cost bounded whatever its length."""
    if len(text) <= bound:
        return text
    return text[:bound // 2] + "\n" + text[-(bound // 2 - 1):]


def _codes(text: str) -> tuple[np.ndarray, int]:
    """[L] uint64 code points with ASCII lower-cased and digits folded to '0'; and the upper-case count."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    upper = (codes >= 65) & (codes <= 90)
    codes[upper] += np.uint64(32)
    codes[(codes >= 49) & (codes <= 57)] = 48
    return codes, int(np.count_nonzero(upper))


def _bucket(h: np.ndarray, seed: np.uint64) -> np.ndarray:
    """[K] uint64 hashes -> [K] int64 buckets in [DENSE, 2**HASH_BITS) (multiplicative hashing, high bits)."""
    mixed = ((h ^ seed) * _MIX) >> np.uint64(64 - HASH_BITS)
    return np.maximum(mixed.astype(np.int64), DENSE)


def _log_scale(value: float, cap: float) -> float:
    return min(1.0, math.log1p(max(0.0, value)) / math.log1p(cap))


def dense_features(req: RequestText, text: str, codes: np.ndarray, words: int, upper: int) -> np.ndarray:
    """[DENSE] float32, each in 0..1."""
    digits = int(np.count_nonzero(codes == 48))
    numbers = int(np.count_nonzero((codes[1:] == 48) & (codes[:-1] != 48))) + int(len(codes) > 0 and codes[0] == 48)
    n = max(SHARE_FLOOR, len(text))  # a short text's one capital or digit is no "high share"
    sizes = [_log_scale(req.prompt_chars, 1e6), _log_scale(len(req.last_user), 1e6), _log_scale(words, 1e5),
             _log_scale(text.count("\n"), 1e4), _log_scale(numbers, 1e4), _log_scale(req.turns, 1e3),
             _log_scale(req.max_tokens or 0, 1e5), min(1.0, text.count("?") / 5), digits / n,
             min(1.0, 4 * upper / n)]
    choices = len(_CHOICE.findall(text)) >= 2
    base = np.asarray(sizes, dtype=np.float32)
    return np.concatenate([base * (not choices), base * choices, structure.signals(text[:STRUCTURE_CHARS], choices),
                           np.float32([choices, 1.0])])


def featurize(req: RequestText) -> Features:
    """The request's features (module docstring); cost bounded by SCAN_CHARS."""
    text = scanned(req.last_user)
    codes, upper = _codes(text)  # [L]
    length = len(codes)
    prefix = np.zeros(length + 1, dtype=np.uint64)
    np.cumsum(codes * _QQ[:length], out=prefix[1:])  # prefix[i] = sum_{j<i} c_j * P^-j

    def span_hash(start: np.ndarray, end: np.ndarray) -> np.ndarray:  # = sum_{j in [start,end)} c_j P^(end-1-j)
        return (prefix[end] - prefix[start]) * _PP[end - 1]

    # words: runs of ASCII letters/digits or any non-ASCII character
    is_word = ((codes >= 97) & (codes <= 122)) | ((codes >= 48) & (codes <= 57)) | (codes > 127)
    edges = np.diff(np.concatenate(([False], is_word, [False])).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    index, value, spans = [], [], {}
    if len(starts) and ("w" in HASHED or "p" in HASHED):
        words = span_hash(starts, ends)
        if "w" in HASHED:
            spans["w"] = np.stack([starts, ends], axis=1)
            index.append(_bucket(words, _SEEDS["w"]))
        if len(words) > 1 and "p" in HASHED:
            spans["p"] = np.stack([starts[:-1], ends[1:]], axis=1)
            index.append(_bucket(words[:-1] * _PAIR + words[1:], _SEEDS["p"]))
    for n in NGRAMS:
        if length >= n and f"c{n}" in HASHED:
            start = np.arange(length - n + 1)
            spans[f"c{n}"] = np.stack([start, start + n], axis=1)
            index.append(_bucket(span_hash(start, start + n), _SEEDS[f"c{n}"]))
    for idx in index:
        value.append(np.full(len(idx), 1.0 / math.sqrt(len(idx)), dtype=np.float32))
    dense = dense_features(req, text, codes, len(starts), upper)
    if not index:
        return Features(dense, np.zeros(0, np.int64), np.zeros(0, np.float32), spans, text)
    return Features(dense, np.concatenate(index), np.concatenate(value), spans, text)
