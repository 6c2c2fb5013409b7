"""Money as integers, so that sums are exact on Postgres and SQLite alike.

A price is given per 1M tokens with at most 6 decimals and stored in micro-units per 1M tokens;
the cost of one token is then price_micros / 10^12 of the currency, so a request's cost in
pico-units (10^-12) is an integer: tokens x price_micros. Every amount we show is that integer
turned into a Decimal; nothing is rounded on the way, so any sum reconciles to the last digit.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

MICRO_DIGITS = 6
PICO_DIGITS = 12
MAX_PRICE = Decimal(10) ** 9  # per 1M tokens; far above any real price, and it keeps costs in 64 bits
_CURRENCY = re.compile(r"[A-Z]{3}")  # matched whole


class MoneyError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_price(value: object, param: str) -> int:
    """'0.15' (per 1M tokens) -> 150000 micro-units; refuses negatives, NaN and more than 6 decimals."""
    if isinstance(value, bool) or value is None:
        raise MoneyError(f"{param} must be a decimal number, got {value!r}", param)
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise MoneyError(f"{param} must be a decimal number, got {value!r}", param) from None
    if not amount.is_finite() or amount < 0:
        raise MoneyError(f"{param} must be a finite number >= 0, got {value!r}", param)
    if amount >= MAX_PRICE:
        raise MoneyError(f"{param} must be below {MAX_PRICE} per 1M tokens, got {value!r}", param)
    micros = amount.scaleb(MICRO_DIGITS)
    if micros != micros.to_integral_value():
        raise MoneyError(f"{param} may have at most {MICRO_DIGITS} decimals, got {value!r}", param)
    return int(micros)


def check_currency(value: object) -> str:
    if not isinstance(value, str) or not _CURRENCY.fullmatch(value):
        raise MoneyError(f"currency must be three capital letters (ISO 4217, e.g. USD), got {value!r}", "currency")
    return value


def _text(units: int, digits: int) -> str:
    """Exact decimal text with trailing zeros cut down to two decimals: 1.5 -> '1.50', 1e-7 -> '0.0000001'."""
    text = f"{Decimal(units).scaleb(-digits):.{digits}f}"
    whole, _, frac = text.partition(".")
    frac = frac.rstrip("0")
    return f"{whole}.{frac.ljust(2, '0')}"


def micros_text(micros: int) -> str:
    return _text(micros, MICRO_DIGITS)


def picos_text(picos: int) -> str:
    return _text(picos, PICO_DIGITS)
