"""The model's vocabulary as llguidance sees it: every id's bytes, its special ids and end-of-sequence.

Built from our own Tokenizer (HF `tokenizers` or a GGUF vocabulary), never from the hub. Ids past the
tokenizer, up to the logits' width, are empty specials: llguidance never allows them.
"""

from __future__ import annotations

import threading
import weakref

import llguidance

from loraplex.engine.models.tokenizer import Tokenizer


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: tokens as bytes, specials, EOS, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, width: int, eos: list[int]):
        data = tokenizer.token_bytes()[:width]
        self.tokens = list(data) + [b""] * (width - len(data))
        self.special_token_ids = sorted({i for i in tokenizer.special_ids if i < width} | set(range(len(data), width)))
        self.eos_token_id = eos[0]
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GuideTokenizer:
    """One tokenizer's llguidance view for logits `width` wide; `words` is a bitmask row's int32 count."""

    def __init__(self, tokenizer: Tokenizer, width: int):
        eos = sorted(i for i in tokenizer.eos_token_ids if i < width) or [width - 1]
        self.width = width
        self.words = (width + 31) // 32
        self.eos_ids = tuple(eos)
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, width, eos)),
                                         n_vocab=width, eos_token=eos)


_BY_TOKENIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def guide_tokenizer(tokenizer: Tokenizer, width: int) -> GuideTokenizer:
    """The one GuideTokenizer of `tokenizer` at `width`, built on first use (~0.2 s for a 49K vocabulary)
    and shared by every frontend of that tokenizer."""
    with _LOCK:
        per_tokenizer = _BY_TOKENIZER.setdefault(tokenizer, {})
        if width not in per_tokenizer:
            per_tokenizer[width] = GuideTokenizer(tokenizer, width)
        return per_tokenizer[width]
