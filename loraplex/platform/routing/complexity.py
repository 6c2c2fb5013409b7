r"""How demanding a request looks, scored from 0 to 1 from the request alone: `auto`'s heuristic.

- The learned scorer (routing/learned/) is `auto`'s default and reads these signals as features; with
  LORAPLEX_ROUTER=heuristic the router (auto.py) sends a request to the cheapest model whose `auto_max_complexity` is
  at least this score.
- An operator can predict it: a weighted sum of named signals, each 0-1, capped at 1, all read off the request's own
  text and fields (no model is run):

| signal    | weight | 0                           | 1                                                  |
|-----------|--------|-----------------------------|----------------------------------------------------|
| length    | 0.25   | prompt of 400 chars or less | 32,000 chars (log-scaled between)                  |
| output    | 0.10   | max_tokens 128 or less, or none | 4,096 (log-scaled between)                    |
| code      | 0.25   | no sign of code             | a fenced block, 3+ code-like lines, or 3+ code terms |
| math      | 0.20   | no sign of math             | LaTeX, an equation, or 3+ math terms               |
| reasoning | 0.25   | no analysis asked for       | 3+ of: step by step, prove, why, compare, trade-off... |
| multipart | 0.15   | one ask                     | 5+ questions or list items                         |
| dialogue  | 0.10   | 4 turns or fewer            | 16+ turns                                          |

- Content signals read the last user turn (what is asked now; a system prompt is fixed per application and would
  score every request alike), at most SCAN_CHARS (8,000) characters of it: its first and last 4,000 when longer, so
  the score costs the same for a 10 KB turn as for a 10 MB one. Length reads the whole prompt's size.
- Terms count once each, whole words only.
- Every pattern runs in linear time, so no text makes a score slow: `[ \t]*` where a line's indentation is meant,
  never `\s*` under MULTILINE (which would run across blank lines from every line start), and no nested quantifiers.
- Examples (tests/unit/test_auto_route.py holds them): "Hello" scores 0; "Write a Python function that parses dates"
  0.17; a proof by induction asked for step by step, with LaTeX, 0.37; a code review with a fenced block and four
  numbered questions 0.65, and 0.95 at the end of a 12K-character conversation that asks for 2048 tokens.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

WEIGHTS: dict[str, float] = {"length": 0.25, "output": 0.10, "code": 0.25, "math": 0.20, "reasoning": 0.25,
                             "multipart": 0.15, "dialogue": 0.10}

_CODE_TERMS = frozenset((
    "code", "function", "class", "method", "compile", "compiler", "bug", "debug", "stack", "traceback",
    "exception", "regex", "sql", "query", "api", "python", "javascript", "typescript", "java", "rust", "golang",
    "c++", "bash", "shell", "script", "refactor", "implement", "algorithm", "recursion", "json", "yaml", "html",
    "css", "unittest", "pytest", "dockerfile", "kubernetes", "git", "library", "runtime", "segfault",
))
_MATH_TERMS = frozenset((
    "prove", "proof", "theorem", "lemma", "integral", "derivative", "differentiate", "integrate", "equation",
    "matrix", "eigenvalue", "probability", "expected", "variance", "limit", "series", "polynomial", "modulo",
    "prime", "induction", "optimize", "optimum", "logarithm", "vector", "calculus", "algebra", "geometry",
))
_REASONING_PHRASES = (
    "step by step", "explain why", "why does", "why is", "why do", "prove", "compare", "contrast", "trade-off",
    "tradeoff", "pros and cons", "analyze", "analyse", "evaluate", "justify", "critique", "design", "plan",
    "reason about", "derive", "root cause", "what would happen", "implications", "assess", "strategy",
)
SCAN_CHARS = 8_000
_REASONING = re.compile(r"\b(?:" + "|".join(re.escape(p) for p in _REASONING_PHRASES) + r")\b")
_WORD = re.compile(r"[a-z][a-z0-9+#]*")
_FENCE = re.compile(r"```|~~~")
# `[ \t]*+` (possessive) gives nothing back to `.*`, which would otherwise retry every split of a line's indentation
_CODE_LINE = re.compile(r"^[ \t]*+(?:def |class |import |from \S+ import |return\b|for[ \t]*\(|if[ \t]*\(|#include|"
                        r"(?:const|let|var|fn|func|public|private)\s|SELECT\s|.*[;{}][ \t]*$)", re.MULTILINE)
_LATEX = re.compile(r"\\(frac|sum|int|sqrt|lim|prod|begin|alpha|beta|theta|cdot|leq|geq)\b|\$[^$\n]+\$")
_EQUATION = re.compile(r"[a-zA-Z0-9)\]]\s*(\^|\*\*)\s*\d|\b\d+\s*[-+*/^]\s*\d+\s*=|\b[a-z]\s*=\s*[-\d(]")
_ASK = re.compile(r"\?|^[ \t]*+(?:\d+[.)]|[-*•])[ \t]+\S", re.MULTILINE)


@dataclass(frozen=True)
class RequestText:
    """What the score reads: the last user turn, the whole prompt's size, the turns, max_tokens."""

    last_user: str
    prompt_chars: int
    turns: int = 1
    max_tokens: int | None = None


@dataclass(frozen=True)
class Complexity:
    score: float  # 0..1
    signals: dict[str, float]  # each signal's value, 0..1, before its weight


def _log_ramp(value: float, low: float, high: float) -> float:
    """0 at `low` or less, 1 at `high` or more, log-linear between."""
    if value <= low:
        return 0.0
    return min(1.0, math.log(value / low) / math.log(high / low))


def _count_ramp(hits: int, full: int = 3) -> float:
    return min(1.0, hits / full)


def _code(text: str, words: set[str]) -> float:
    if _FENCE.search(text) or len(_CODE_LINE.findall(text)) >= 3:
        return 1.0
    return _count_ramp(len(words & _CODE_TERMS))


def _math(text: str, words: set[str]) -> float:
    if _LATEX.search(text) or _EQUATION.search(text):
        return 1.0
    return _count_ramp(len(words & _MATH_TERMS))


def _reasoning(lowered: str) -> float:
    return _count_ramp(len(set(_REASONING.findall(lowered))))


def _multipart(text: str) -> float:
    asks = len(_ASK.findall(text))
    return min(1.0, max(0, asks - 1) / 4)


def _scanned(text: str) -> str:
    """The first and last SCAN_CHARS / 2 of a longer turn: the ask is usually at one end, and the
    cost of a score stays bounded whatever the turn's length."""
    if len(text) <= SCAN_CHARS:
        return text
    return f"{text[:SCAN_CHARS // 2]}\n{text[-(SCAN_CHARS // 2):]}"


def score(req: RequestText) -> Complexity:
    text = _scanned(req.last_user)
    lowered = text.lower()
    words = set(_WORD.findall(lowered))
    signals = {
        "length": _log_ramp(req.prompt_chars, 400, 32_000),
        "output": _log_ramp(req.max_tokens or 0, 128, 4096),
        "code": _code(text, words),
        "math": _math(text, words),
        "reasoning": _reasoning(lowered),
        "multipart": _multipart(text),
        "dialogue": _log_ramp(req.turns, 4, 16),
    }
    total = sum(WEIGHTS[name] * value for name, value in signals.items())
    return Complexity(round(min(1.0, total), 4), signals)
