"""One request's guided decoding: its schema's llguidance matcher, its token mask, the tokens it follows.

The mask of a step is filled on a worker thread (masks.py) while the forward pass runs, and the sampler
waits for it at most until `mask_timeout_s` after the step started; where no core is spare, the
sampler fills it, and a fill longer than `mask_timeout_s` fails the same way. A mask that errors (llguidance's
fuel ran out), leaves no token, or is late sets `error`: the core then ends this request alone.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import numpy as np

from loraplex.engine.guided.grammar import explain
from loraplex.engine.guided.tokenizer import GuideTokenizer

# A mask byte's 8 tokens (bit i: token i allowed) as additive logits: 0 where allowed, -inf where not.
_BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)  # [256, 8]


class Guide:
    """Masks a request's logits to the tokens its schema allows, and follows the tokens it samples."""

    def __init__(self, tokenizer: GuideTokenizer, matcher: llguidance.LLMatcher, mask_timeout_s: float):
        self.tokenizer = tokenizer
        self.matcher = matcher
        self.mask_timeout_s = mask_timeout_s
        self.bits = np.zeros(tokenizer.words, dtype=np.int32)  # the step's mask from llguidance, a bit per token
        # the same as additive logits (0 / -inf): adding it costs a fraction of a masked_fill_
        self.bias = np.zeros(tokenizer.words * 32, dtype=np.float32)
        self._bits_ptr, self._bits_bytes = self.bits.ctypes.data, self.bits.view(np.uint8)
        self._bias_by_byte = self.bias.reshape(-1, 8)
        self.error: str | None = None
        self._pending: Future | None = None
        self._started = 0.0

    def start_mask(self, pool: Executor) -> None:
        """Begins this step's mask on `pool` (llguidance drops the GIL while it fills)."""
        if self._pending is None and self.error is None:
            self._started = time.monotonic()
            self._pending = pool.submit(self._fill)

    def _fill(self) -> None:
        """The mask (llguidance, without the GIL), turned into `bias` here too: off the engine thread."""
        self.matcher.unsafe_compute_mask_ptr(self._bits_ptr, self.bits.nbytes)
        np.take(_BYTE_BIAS, self._bits_bytes, axis=0, out=self._bias_by_byte)

    def mask(self) -> np.ndarray | None:
        """This step's mask as logits to add, [width] fp32: 0 for the tokens the schema allows here, -inf
        for the others; None, with `error` set, when it failed or was not ready within the step's limit."""
        if self.error is not None:
            return None
        if self._pending is None:  # not started ahead (no spare core, or a caller outside a step): fill it now
            started = time.monotonic()
            self._fill()
            if time.monotonic() - started > self.mask_timeout_s:
                self.error = self._late()
                return None
        else:
            try:
                self._pending.result(timeout=max(0.0, self._started + self.mask_timeout_s - time.monotonic()))
            except FutureTimeout:  # the worker may still be filling: this guide is done
                self.error = self._late()
                return None
            except Exception as e:  # noqa: BLE001 - a failed mask ends this request, never the step
                self.error = f"the JSON schema's token mask failed: {e}"
                return None
            self._pending = None
        if self.matcher.is_error():
            self.error = f"the JSON schema's token mask failed: {explain(self.matcher.get_error())}"
            return None
        if not self.bits.any():
            self.error = "no token of this model can continue the JSON value here"
            return None
        return self.bias[:self.tokenizer.width]

    @property
    def ahead(self) -> bool:
        """This step's mask was started before the forward pass (so it must be collected)."""
        return self._pending is not None

    def allows(self, token_id: int) -> bool:
        """The schema allows `token_id` next (a check of one token, microseconds, where a mask fills a
        bit for every token of the vocabulary). End-of-sequence is allowed once the value is whole."""
        if self.error is not None or not 0 <= token_id < self.tokenizer.width:
            return False
        if token_id in self.tokenizer.eos_ids:
            return self.matcher.is_accepting()
        return self.matcher.validate_tokens([token_id]) == 1

    def _late(self) -> str:
        """The error of a mask past the step's limit."""
        return (f"the JSON schema's token mask took longer than {self.mask_timeout_s * 1000:g} ms "
                "(the engine's per-step limit)")

    def accept(self, token_id: int) -> bool:
        """Moves past a sampled token (end-of-sequence ends the request elsewhere). False for a token
        the mask did not allow (a sampler fault: the core ends that request)."""
        if token_id in self.tokenizer.eos_ids:
            return True
        return self.matcher.consume_token(token_id)

    @property
    def complete(self) -> bool:
        """The output is one whole value and nothing may follow: the request can stop now."""
        return self.matcher.is_stopped() and not self.matcher.is_error()
