"""Byte rules of JSON strings (UTF-8 included) and the reach of bounded integers, shared by the
matcher (matcher.py) and the vocabulary index (vocab.py)."""

from __future__ import annotations

QUOTE, BACKSLASH = 0x22, 0x5C
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')

# UTF-8 progress inside a string: 0 = between characters; 1-3 = that many continuation bytes owed,
# each 80-BF; 4-7 = after a lead byte whose first continuation is narrower (no overlong forms, no
# surrogates, nothing past U+10FFFF): (lowest, highest, bytes owed after it).
UTF8_STATES = 8
_NARROW_FIRST = {4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1), 6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}
_LEADS = {**dict.fromkeys(range(0xC2, 0xE0), 1), 0xE0: 4, **dict.fromkeys(range(0xE1, 0xF0), 2), 0xED: 5,
          0xF0: 6, **dict.fromkeys(range(0xF1, 0xF4), 3), 0xF4: 7}

CLOSE = "close"  # string_step's answer for the closing quote


def utf8_lead(b: int) -> int | None:
    """The UTF-8 state after lead byte `b` (>= 0x80), or None where `b` cannot start a character."""
    return _LEADS.get(b)


def utf8_continue(pending: int, b: int) -> int | None:
    """The UTF-8 state after continuation byte `b` where `pending` (> 0) is owed, or None."""
    lo, hi, after = _NARROW_FIRST.get(pending, (0x80, 0xBF, pending - 1))
    return after if lo <= b <= hi else None


# Escape progress inside a string: 0 none, 1 after a backslash, 2-5 expecting the \uXXXX's digits 1-4.
# A \u escape starting "d" goes to FIRST_D, where its second digit tells a high surrogate (two more
# digits, then a low surrogate "\udc.." to "\udf.." must follow) from a lone low one (refused) or an
# ordinary code point (back to 4). A surrogate pair is one character, as JSON Schema counts it.
FIRST_D, HIGH_3, HIGH_4, NEED_LOW, LOW_U, LOW_D, LOW_2, LOW_3, LOW_4 = range(10, 19)
_HIGH_SECOND = frozenset(b"89abAB")
_LOW_SECOND = frozenset(b"cdefCDEF")
_ESCAPE_NEXT = {  # state -> (bytes that move on, the state they lead to)
    HIGH_3: (HEX, HIGH_4), HIGH_4: (HEX, NEED_LOW), NEED_LOW: (frozenset(b"\\"), LOW_U),
    LOW_U: (frozenset(b"u"), LOW_D), LOW_D: (frozenset(b"dD"), LOW_2), LOW_2: (_LOW_SECOND, LOW_3),
    LOW_3: (HEX, LOW_4), LOW_4: (HEX, 0),
}


def string_step(pending: int, escape: int, b: int) -> tuple[int, int, bool] | str | None:
    """One byte inside a JSON string in UTF-8 state `pending` and escape progress `escape` (above):
    (pending, escape, whether it starts a character), CLOSE for the closing quote, or None where JSON
    (with surrogates paired) does not allow it."""
    if escape == 0:
        if pending:
            after = utf8_continue(pending, b)
            return None if after is None else (after, 0, False)
        if b == QUOTE:
            return CLOSE
        if b == BACKSLASH:
            return 0, 1, True
        if 0x20 <= b < 0x80:
            return 0, 0, True
        owed = utf8_lead(b)
        return None if owed is None else (owed, 0, True)
    if escape == 1:
        if b in ESCAPES:
            return 0, 0, False
        return (0, 2, False) if b == 0x75 else None  # \u: four hex digits follow
    if escape == 2 and b in (0x64, 0x44):  # "d": a surrogate, or an ordinary code point from D000 to D7FF
        return 0, FIRST_D, False
    if escape == FIRST_D:
        if b in _HIGH_SECOND:
            return 0, HIGH_3, False
        return None if b in _LOW_SECOND or b not in HEX else (0, 4, False)
    if escape in _ESCAPE_NEXT:
        allowed, after = _ESCAPE_NEXT[escape]
        return (0, after, False) if b in allowed else None
    if b not in HEX:
        return None
    return 0, (escape + 1 if escape < 5 else 0), False


def in_string_run(data: bytes, pending: int) -> int | None:
    """For a token without quotes and backslashes: the characters it starts inside a string in UTF-8
    state `pending`, or None where it cannot continue the string (a control byte, bad UTF-8)."""
    starts = 0
    for b in data:
        step = string_step(pending, 0, b)
        if not isinstance(step, tuple):
            return None
        pending, _, started = step
        starts += started
    return starts


def integer_reachable(lo: int | None, hi: int | None, negative: bool, digits: str) -> bool:
    """Whether an integer written so far as `-`? + `digits` can still end in [lo, hi] (None: open)."""
    if negative:  # -m in [lo, hi]  <=>  m in [-hi, -lo]; a minus sign needs m >= 1 (no "-0")
        mlo, mhi = (1 if hi is None else max(-hi, 1)), (None if lo is None else -lo)
    else:
        mlo, mhi = (0 if lo is None else max(lo, 0)), hi
    if mhi is not None and mhi < mlo:
        return False
    if not digits:
        return True
    d = int(digits)
    if d == 0:  # a leading 0 is the whole number
        return mlo == 0 and not negative
    span = 1  # the magnitudes reachable with j more digits: [d * 10^j, d * 10^j + 10^j - 1]
    while mhi is None or d * span <= mhi:
        if d * span + span - 1 >= mlo:
            return True
        span *= 10
    return False


def integer_in_range(lo: int | None, hi: int | None, negative: bool, digits: str) -> bool:
    value = -int(digits) if negative else int(digits)
    return (lo is None or value >= lo) and (hi is None or value <= hi)
