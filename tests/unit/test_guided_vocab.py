"""Token masks of guided decoding (engine/guided/vocab.py) against brute force: a token is allowed
exactly when the matcher accepts all its bytes from the current state, on a small made-up vocabulary
and on the default model's real one (with its tokens that split UTF-8 characters)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loraplex.engine.guided.guide import Guide
from loraplex.engine.guided.vocab import GuideVocabulary
from tests.unit.test_guided_matcher import PERSON, TREE

EOS, SPECIAL = 0, 1


def small_vocab() -> GuideVocabulary:
    rng = random.Random(3)
    alphabet = '{}[]:,"\\ \n0123456789.-eEtrufalsn abz/'
    tokens = [b"</s>", b"<|special|>"] + [bytes((b,)) for b in range(256)]
    tokens += ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6))).encode() for _ in range(3000)]
    tokens += [b"\xc3", b"\xa9", b"a\xc3", b"\xa9b", b"\xe2\x82", b"\xac\"", "é€".encode(), b'": "', b'"}', b"",
               b"\xe0", b"\xed", b"\xf4", b"\x80\x80", b"\x90\x80", b"\xa0\x80\x80"]
    return GuideVocabulary(tokens, frozenset({EOS, SPECIAL}), frozenset({EOS}), len(tokens) + 5)


def brute_force(guide: Guide) -> torch.Tensor:
    vocab, m, state = guide.vocab, guide.matcher, guide.state
    keep = torch.zeros(vocab.width, dtype=torch.bool)
    specials = set(range(vocab.width)) - set(vocab.sorted_ids)
    for i, data in enumerate(vocab.token_bytes):
        if i not in specials and data and m.advance_bytes(state, data) is not None:
            keep[i] = True
    if m.accepts(state) or not keep.any():
        keep[vocab.eos_ids] = True
    return keep


def check_random_walks(vocab: GuideVocabulary, schema: dict, seeds: range, steps: int) -> int:
    """Follows random allowed tokens from the start, comparing every state's mask; returns states checked."""
    checked = 0
    for seed in seeds:
        rng = random.Random(seed)
        guide = Guide(vocab, json.dumps(schema))
        for _ in range(steps):
            mask = ~vocab.blocked(guide.matcher, guide.state)
            assert torch.equal(mask, brute_force(guide)), guide.state
            checked += 1
            allowed = [i for i in mask.nonzero().flatten().tolist() if i not in vocab.eos_ids.tolist()]
            if guide.complete or not allowed:
                break
            guide.accept(rng.choice(allowed))
    return checked


BOUNDED = {"type": "object", "properties": {
    "code": {"type": "string", "minLength": 2, "maxLength": 5},
    "n": {"type": "integer", "minimum": -20, "maximum": 300}, "k": {"type": "integer", "minimum": 7}},
    "required": ["code", "n", "k"]}


@pytest.mark.parametrize("schema", [{"type": "object"}, PERSON, TREE, BOUNDED])
def test_small_vocabulary_masks_equal_brute_force(schema):
    assert check_random_walks(small_vocab(), schema, range(6), 60) >= 60


def test_special_tokens_never_and_eos_only_once_complete():
    vocab = small_vocab()
    guide = Guide(vocab, json.dumps({"type": "object"}))
    assert not ~vocab.blocked(guide.matcher, guide.state)[[EOS, SPECIAL]].any()
    for b in b"{}":
        guide.accept(2 + b)  # the single-byte tokens start at id 2
    assert guide.complete
    mask = ~vocab.blocked(guide.matcher, guide.state)
    assert mask[EOS] and mask.sum() == 1
    assert not mask[len(vocab.token_bytes):].any()  # ids past the tokenizer (padded logits) never


def test_a_token_outside_the_mask_is_refused_not_a_silent_jump():
    guide = Guide(small_vocab(), json.dumps({"type": "object"}))
    start = guide.state
    assert not guide.accept(2 + ord("["))
    assert guide.state == start
    assert guide.accept(2 + ord("{")) and guide.state != start


def test_masking_logits_leaves_only_allowed_tokens():
    vocab = small_vocab()
    guide = Guide(vocab, json.dumps({"type": "array"}))
    logits = torch.randn(vocab.width)
    guide.mask(logits)
    finite = torch.isfinite(logits)
    assert torch.equal(finite, ~vocab.blocked(guide.matcher, guide.state))
    assert finite[2 + ord("[")] and not finite[2 + ord("{")]


@pytest.fixture(scope="module")
def real_vocab(default_model) -> GuideVocabulary:
    tok = default_model.tokenizer
    return GuideVocabulary(tok.token_bytes(), tok.special_ids, tok.eos_token_ids, default_model.config.vocab_size)


@pytest.mark.parametrize("prefix", [
    b"", b"{", b'{"na', b'{"name": "Zo', b'{"name": "\xe2', b'{"name": "\xe2\x82', b'{"name": "\xe0', b'{"name": "\xf4',
    b'{"name": "\xf0\x90', b'{"name": "\\', b'{"name": "\\u1',
    b'{"name": "x", "age": 1', b'{"name": "x", "age": 12, "tags": [', b'{"name": "x", "age": 12, "tags": ["a"]',
])
def test_default_model_vocabulary_masks_equal_brute_force(real_vocab, prefix):
    guide = Guide(real_vocab, json.dumps(PERSON))
    guide.state = guide.matcher.advance_bytes(guide.state, prefix)
    assert guide.state is not None
    assert torch.equal(~real_vocab.blocked(guide.matcher, guide.state), brute_force(guide))


def test_default_model_random_walks_in_json_mode(real_vocab):
    assert check_random_walks(real_vocab, {"type": "object"}, range(2), 8) >= 8


@pytest.mark.parametrize("prefix", [b'{"code": "', b'{"code": "ab', b'{"code": "abc\xe2', b'{"code": "abcd',
                                    b'{"code": "ab", "n": ', b'{"code": "ab", "n": 2', b'{"code": "ab", "n": -'])
def test_default_model_masks_for_bounded_strings_and_integers(real_vocab, prefix):
    guide = Guide(real_vocab, json.dumps(BOUNDED))
    guide.state = guide.matcher.advance_bytes(guide.state, prefix)
    assert guide.state is not None
    assert torch.equal(~real_vocab.blocked(guide.matcher, guide.state), brute_force(guide))
