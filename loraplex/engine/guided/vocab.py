"""Which tokens a matcher state allows: a walk of the tokenizer's byte trie, cached per state.

Why a sorted array and not a dict trie: tokens sorted by their bytes form the same trie (a prefix is a
contiguous range, found by bisection), at no memory cost beyond the list.

The walk visits only the children of live states, so a state between JSON values (a few structural
bytes allowed) costs a few hundred transitions. Inside a string nearly every token is allowed and a
walk would visit the whole trie, so there a fast path takes the precomputed mask of tokens that stay
inside a string (no quote, no backslash, no control byte, valid UTF-8 from where the string stands,
no more characters than a `maxLength` leaves room for) and walks only the tokens holding a quote or
a backslash. Masks are cached per (matcher, state): decoding a schema revisits a small set of states.
"""

from __future__ import annotations

import re
import threading
import weakref
from bisect import bisect_left
from collections import OrderedDict

import torch

from loraplex.engine.guided.matcher import Matcher, State
from loraplex.engine.guided.scalars import UTF8_STATES, in_string_run

CACHE_ENTRIES = 512  # masks of 49K-token vocabularies: 25 MB at most per model
_CONTROL = re.compile(rb"[\x00-\x1f]")


class GuideVocabulary:
    """One tokenizer's tokens for guided decoding. `width` is the logits' width (the model may pad
    its vocabulary past the tokenizer's); special tokens other than end-of-sequence are never allowed."""

    def __init__(self, token_bytes: list[bytes], special_ids: frozenset[int], eos_ids: frozenset[int], width: int,
                 device: torch.device | str = "cpu"):
        self.token_bytes = token_bytes
        self.device = torch.device(device)
        self.width = width
        self.eos_ids = torch.tensor(sorted(i for i in eos_ids if i < width), dtype=torch.long)
        self._eos = frozenset(eos_ids)
        ids = [i for i, t in enumerate(token_bytes[:width]) if t and i not in special_ids]
        ids.sort(key=token_bytes.__getitem__)
        self.sorted_ids = ids
        self.sorted_bytes = [token_bytes[i] for i in ids]
        self.quoted = [i for i in ids if b'"' in token_bytes[i] or b"\\" in token_bytes[i]]
        # [utf8 state, vocab]: the characters a plain token starts inside a string from that state, -1 where it
        # cannot continue the string
        starts = torch.full((UTF8_STATES, width), -1, dtype=torch.int16)
        plain = [i for i in ids if b'"' not in token_bytes[i] and b"\\" not in token_bytes[i]]
        for i in plain:
            data = token_bytes[i]
            if data.isascii():
                if _CONTROL.search(data) is None:
                    starts[0, i] = len(data)
            else:
                for pending in range(UTF8_STATES):
                    run = in_string_run(data, pending)
                    if run is not None:
                        starts[pending, i] = run
        self.string_starts = starts
        self.in_string = starts >= 0
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def is_eos(self, token_id: int) -> bool:
        return token_id in self._eos

    def blocked(self, matcher: Matcher, state: State) -> torch.Tensor:
        """[width] bool on the engine's device, True for the tokens the schema does not allow here:
        those that leave it, special tokens, and end-of-sequence until the value is complete. Never
        all True: at a dead end (no token fits) end-of-sequence is allowed. Cached per state, so a
        step costs one lookup and one masked_fill_."""
        key = (matcher, state)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        keep = self._allowed(matcher, state)
        if matcher.accepts(state) or not keep.any():
            keep[self.eos_ids] = True
        blocked = (~keep).to(self.device)
        with self._lock:
            self._cache[key] = blocked
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return blocked

    def _allowed(self, matcher: Matcher, state: State) -> torch.Tensor:
        """[width] bool (CPU): the tokens whose bytes the matcher accepts from `state`."""
        rooms = matcher.string_rooms(state)
        if rooms is not None:
            keep = torch.zeros(self.width, dtype=torch.bool)
            for pending, room in rooms:
                keep |= self.in_string[pending] if room is None else \
                    self.in_string[pending] & (self.string_starts[pending] <= room)
            for i in self.quoted:
                if matcher.advance_bytes(state, self.token_bytes[i]) is not None:
                    keep[i] = True
            return keep
        ids: list[int] = []
        self._walk(matcher, state, 0, len(self.sorted_ids), 0, ids)
        keep = torch.zeros(self.width, dtype=torch.bool)
        keep[ids] = True
        return keep

    def _walk(self, matcher: Matcher, state: State, lo: int, hi: int, depth: int, out: list[int]) -> None:
        """Appends the ids of tokens in [lo, hi) (all sharing their first `depth` bytes, which led to
        `state`) that the matcher accepts from there."""
        toks = self.sorted_bytes
        i = lo
        while i < hi and len(toks[i]) == depth:  # tokens that end here: sorted before their extensions
            out.append(self.sorted_ids[i])
            i += 1
        while i < hi:
            b = toks[i][depth]
            j = hi if b == 0xFF else bisect_left(toks, toks[i][:depth] + bytes((b + 1,)), i, hi)
            nxt = matcher.advance(state, b)
            if nxt is not None:
                self._walk(matcher, nxt, i, j, depth + 1, out)
            i = j


_BY_TOKENIZER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BY_TOKENIZER_LOCK = threading.Lock()


def vocabulary_for(tokenizer, width: int, device: torch.device | str = "cpu") -> GuideVocabulary:
    """The one index of `tokenizer` for logits `width` wide on `device`, built on first use (a few
    hundred ms for a 49K vocabulary) and shared by every frontend of that tokenizer."""
    with _BY_TOKENIZER_LOCK:
        per_tokenizer = _BY_TOKENIZER.setdefault(tokenizer, {})
        key = (width, str(torch.device(device)))
        if key not in per_tokenizer:
            per_tokenizer[key] = GuideVocabulary(tokenizer.token_bytes(), tokenizer.special_ids,
                                                 tokenizer.eos_token_ids, width, device)
        return per_tokenizer[key]
