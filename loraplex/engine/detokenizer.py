"""Streaming token ids -> text, one generated token at a time.

Works on each token's bytes (Tokenizer.token_bytes) through an incremental UTF-8 decoder, so a
character split across tokens comes out once, whole, and never as a replacement character in
between. Stop strings are matched on the text: any tail that could still grow into a stop string
is held back until it either completes one (generation stops, the stop string is never emitted)
or cannot any more. Each push is O(len(new text) + held-back text), independent of output length.
"""

from __future__ import annotations

import codecs
from collections.abc import Collection, Sequence


class IncrementalDetokenizer:
    """One request's output text. `push` returns only the newly completed text."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids: Collection[int],
                 skip_special_tokens: bool = True, stop: tuple[str, ...] = ()):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._token_bytes = token_bytes
        self._special_ids = special_ids
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet returned: it may be the start of a stop string
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Feeds one generated token; returns the text it completes ("" while a character or a
        possible stop string is incomplete, and always "" once stopped)."""
        if self.stopped:
            return ""
        if self._skip_special and token_id in self._special_ids:
            return ""
        data = self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""
        text = self._decoder.decode(data)
        if not self._stop:
            return text
        return self._release(self._held + text, final=False)

    def flush(self) -> str:
        """The held-back text at the end of generation (and a replacement character for an
        unfinished UTF-8 sequence)."""
        if self.stopped:
            return ""
        text = self._decoder.decode(b"", final=True)
        if not self._stop:
            return text
        return self._release(self._held + text, final=True)

    def _release(self, text: str, final: bool) -> str:
        # A stop string can only start inside `text`: earlier text was released only once no
        # suffix of it could begin one.
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = 0 if final else self._stop_prefix_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
