"""One request's guided decoding: its schema's matcher, where the output stands, and its token mask."""

from __future__ import annotations

from functools import lru_cache

import torch

from loraplex.engine.guided.matcher import Matcher
from loraplex.engine.guided.schema import Grammar, compile_schema
from loraplex.engine.guided.vocab import GuideVocabulary


@lru_cache(maxsize=64)
def matcher_for(grammar: Grammar) -> Matcher:
    """One matcher per compiled schema, so its transition memo serves every request on that schema
    (64 schemas in use at once at most keep their memos; a 65th evicts the least recently used)."""
    return Matcher(grammar)


class Guide:
    """Masks a request's logits to the tokens its schema allows, and follows the tokens it samples."""

    def __init__(self, vocab: GuideVocabulary, schema_text: str):
        self.vocab = vocab
        self.matcher = matcher_for(compile_schema(schema_text))  # SchemaError on a bad schema
        self.state = self.matcher.start

    def mask(self, logits: torch.Tensor) -> None:
        """logits: [vocab] of this request; disallowed tokens become -inf, in place."""
        logits.masked_fill_(self.vocab.blocked(self.matcher, self.state), float("-inf"))

    def accept(self, token_id: int) -> bool:
        """Moves past a sampled token (end-of-sequence ends the request elsewhere). False, and no
        move, for a token the mask did not allow (a sampler fault: the core ends that request)."""
        if self.vocab.is_eos(token_id):
            return True
        state = self.matcher.advance_bytes(self.state, self.vocab.token_bytes[token_id])
        if state is None:
            return False
        self.state = state
        return True

    @property
    def complete(self) -> bool:
        """The output is one whole value and nothing may follow: the request can stop now."""
        return self.matcher.terminal(self.state)
