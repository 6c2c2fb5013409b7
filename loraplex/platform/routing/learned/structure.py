"""Dense signals of how much work a prompt asks for, read from its structure: what held-out subjects share.

- Open questions (word problems): how many reasoning steps they imply: numbers (digits and number
  words), distinct numbers, sentences and the sentences that carry numbers, relations between
  quantities (each, per, total, remaining, ratio, twice, half, more than...), fractions, percentages,
  money, decimals, large magnitudes, named actors, time units, conditions.
- Multiple-choice questions: the question apart from its options (its size, numbers, formula
  symbols, a negation such as "which is NOT"), the options' sizes, how many are numbers, and how much
  the options repeat each other's words (compound answers such as "Wrong, Not wrong" or "I and III"
  ask for several judgments at once), and numbered statements or scenarios.
Every value is on a fixed scale in 0..1 (logs capped), so the same text gives the same values in any
process; the text is the scanned turn (features.py bounds it), so the cost is bounded.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np

_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_FRACTION = re.compile(r"\d/\d")
_NAME = re.compile(r"(?<=[a-z,] )[A-Z][a-z]+")
_OPTION = re.compile(r"^[ \t]*\(?[A-Ha-h][.)][ \t]?(.*)$", re.MULTILINE)
_FORMULA = re.compile(r"[=^+*/<>×÷√∫∑πθλμσ]")
_WORD = re.compile(r"[a-z0-9]+")
MAX_OPTIONS = 8  # the options read (their overlap is counted over these)


def _vocabulary(words: str) -> frozenset[str]:
    return frozenset(words.split())


# word lists, counted over the text's words (one regex pass, then set look-ups: word alternations in a
# regex cost ten times as much)
_NUMBER_WORDS = _vocabulary("one two three four five six seven eight nine ten eleven twelve fifteen twenty thirty "
                            "forty fifty hundred thousand million dozen double triple twice half third quarter")
_RELATIONS = _vocabulary("each per every total remaining rest left ratio times more less fewer than average profit "
                         "cost costs spend spends spent earn earns save saves sells buys pays split share shared "
                         "difference combined altogether increase decrease discount")
_FRACTIONS = _vocabulary("half third quarter fourth fifth twice double triple thrice")
_TIME_UNITS = _vocabulary("hour hours minute minutes second seconds day days week weeks month months year years")
_CONDITIONS = _vocabulary("if after then but instead while until unless before")
_NEGATIONS = _vocabulary("not except least false incorrect untrue never cannot")
_STATEMENTS = _vocabulary("statement statements scenario scenarios premise premises ii iii iv")
_SENTENCE_END = np.zeros(128, bool)
_SENTENCE_END[[ord("."), ord("?"), ord("!")]] = True


def _count(words: Counter, vocabulary: frozenset) -> int:
    return sum(words[w] for w in vocabulary)


def _sentences(text: str) -> tuple[int, int]:
    """(sentences, sentences with a digit): sentence ends are . ? ! before a space or the end."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    if len(codes) == 0:
        return 0, 0
    ascii_codes = np.minimum(codes, 127)
    space_after = np.concatenate((np.isin(ascii_codes[1:], (9, 10, 13, 32)), [True]))
    ends = _SENTENCE_END[ascii_codes] & space_after
    sentence = np.cumsum(ends) - ends  # [L] each character's sentence number
    digits = (codes >= 48) & (codes <= 57)
    return int(ends.sum()) + int(not ends[-1]), len(np.unique(sentence[digits]))


OPEN_NAMES = ("open_numbers", "open_distinct_numbers", "open_number_words", "open_sentences",
              "open_number_sentences", "open_relations", "open_fractions", "open_percent", "open_money",
              "open_decimals", "open_large_numbers", "open_names", "open_time_units", "open_conditions",
              "open_commas", "open_words_per_sentence")
CHOICE_NAMES = ("question_chars", "question_numbers", "question_formula", "question_negation",
                "question_which_following", "options", "option_chars_mean", "option_chars_max",
                "options_numeric", "options_overlap", "numbered_statements", "question_share")
NAMES = (*OPEN_NAMES, *CHOICE_NAMES)


def _log(value: float, cap: float) -> float:
    return min(1.0, math.log1p(max(0.0, value)) / math.log1p(cap))


def open_signals(text: str) -> list[float]:
    """OPEN_NAMES' values: the steps a word problem implies."""
    lower = text.lower()
    numbers = _NUMBER.findall(text)
    words = Counter(_WORD.findall(lower))
    sentences, with_numbers = _sentences(text)
    return [_log(len(numbers), 50), _log(len(set(numbers)), 50), _log(_count(words, _NUMBER_WORDS), 50),
            _log(sentences, 50), _log(with_numbers, 50), _log(_count(words, _RELATIONS), 50),
            _log(len(_FRACTION.findall(text)) + _count(words, _FRACTIONS), 20),
            _log(text.count("%") + words["percent"], 20), _log(text.count("$"), 20),
            _log(sum("." in n for n in numbers), 20),
            _log(sum(len(n.replace(",", "").split(".")[0]) >= 4 for n in numbers), 20),
            _log(len(set(_NAME.findall(text))), 20), _log(_count(words, _TIME_UNITS), 20),
            _log(_count(words, _CONDITIONS), 20), _log(text.count(","), 50),
            min(1.0, words.total() / max(1, sentences) / 60)]


def choice_signals(text: str) -> list[float]:
    """CHOICE_NAMES' values: the question apart from its options, and the options."""
    first = _OPTION.search(text)
    question = text[:first.start()] if first else text
    options = [o.strip() for o in _OPTION.findall(text)][:MAX_OPTIONS]
    lower = question.lower()
    question_words = Counter(_WORD.findall(lower))
    option_words = [set(_WORD.findall(o.lower())) for o in options]
    total_words = sum(len(ws) for ws in option_words)
    # the share of an option's words that other options use too: high for compound answers
    uses = Counter(word for ws in option_words for word in ws)
    shared = sum(1 for ws in option_words for word in ws if uses[word] > 1)
    lengths = [len(o) for o in options] or [0]
    numeric = sum(1 for o in options if o and _NUMBER.match(o.lstrip("-$(")))
    return [_log(len(question), 1e4), _log(len(_NUMBER.findall(question)), 50),
            _log(len(_FORMULA.findall(question)), 50),
            min(1.0, _count(question_words, _NEGATIONS) / 2), float("which of the following" in lower),
            _log(len(options), 10), _log(sum(lengths) / len(lengths), 1e3), _log(max(lengths), 1e3),
            numeric / max(1, len(options)), shared / max(1, total_words),
            _log(_count(Counter(_WORD.findall(text.lower())), _STATEMENTS), 10), len(question) / max(1, len(text))]


def signals(text: str, choices: bool) -> np.ndarray:
    """[len(NAMES)] float32: the open signals for an open request, the choice signals for a
    multiple-choice one (the other block zero)."""
    if choices:
        return np.asarray([0.0] * len(OPEN_NAMES) + choice_signals(text), np.float32)
    return np.asarray(open_signals(text) + [0.0] * len(CHOICE_NAMES), np.float32)
