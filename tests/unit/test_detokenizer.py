"""IncrementalDetokenizer: whole UTF-8 characters, stop strings cut and never emitted, flushing."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.models.tokenizer import Tokenizer

BYTES = Tokenizer.byte_level(512)  # one token per byte: every multi-byte character spans tokens


def run(text_or_ids, stop=(), skip_special_tokens=True, tokenizer=BYTES):
    """(pieces returned by push, flush result, detokenizer)."""
    ids = tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    det = IncrementalDetokenizer(tokenizer.token_bytes(), tokenizer.special_ids,
                                 skip_special_tokens=skip_special_tokens, stop=stop)
    pieces = [det.push(i) for i in ids]
    return pieces, det.flush(), det


@pytest.mark.parametrize("char", ["😀", "中", "é", "€"])
def test_multibyte_character_split_across_tokens_is_emitted_once_whole(char):
    pieces, tail, _ = run(f"a{char}b")
    n = len(char.encode())
    assert pieces == ["a"] + [""] * (n - 1) + [char, "b"]
    assert tail == ""


def test_character_split_across_multi_byte_tokens():
    table = [b"x\xf0\x9f", b"\x98", b"\x80\xe4\xb8", b"\xad!"]  # "x😀中!" cut mid-character thrice
    det = IncrementalDetokenizer(table, frozenset())
    assert [det.push(i) for i in range(4)] == ["x", "", "😀", "中!"]


def test_stop_string_spanning_tokens_is_cut_and_never_emitted():
    pieces, tail, det = run("Hello STOP world", stop=("STOP",))
    assert "".join(pieces) + tail == "Hello "
    assert det.stopped and not any("S" in p for p in pieces)
    assert det.push(104) == "" and det.flush() == ""


def test_held_back_prefix_is_released_when_it_stops_matching():
    pieces, tail, det = run("abcxyQ", stop=("xyz",))
    assert pieces == ["a", "b", "c", "", "", "xyQ"] and tail == "" and not det.stopped


def test_held_back_text_is_flushed_at_the_end():
    pieces, tail, det = run("the end</", stop=("</s>",))
    assert "".join(pieces) == "the end" and tail == "</" and not det.stopped


def test_earliest_of_several_stops_wins():
    pieces, tail, det = run("one. two\n\nthree", stop=("\n\n", "two", "three"))
    assert "".join(pieces) + tail == "one. " and det.stopped


def test_stop_inside_one_token_and_after_multibyte():
    table = [b"ok \xe4\xb8", b"\xadSTOPmore"]  # the stop arrives together with the end of "中"
    det = IncrementalDetokenizer(table, frozenset(), stop=("STOP",))
    assert det.push(0) == "ok " and det.push(1) == "中" and det.stopped


def test_special_tokens_skipped_or_emitted():
    ids = BYTES.encode("<|im_start|>hi<|im_end|>") + [300]  # 300: an unused padding id
    assert ids[0] == 257 and ids[-2] == 258
    pieces, tail, _ = run(ids)
    assert "".join(pieces) + tail == "hi"
    pieces, tail, _ = run(ids, skip_special_tokens=False)
    assert "".join(pieces) + tail == "<|im_start|>hi<|im_end|>"
    pieces, tail, det = run(ids, skip_special_tokens=False, stop=("<|im_end|>",))
    assert "".join(pieces) + tail == "<|im_start|>hi" and det.stopped


def test_invalid_utf8_becomes_replacement_characters():
    det = IncrementalDetokenizer([b"a\xff", b"\xe4\xb8"], frozenset())
    assert det.push(0) == "a\ufffd" and det.push(1) == "" and det.flush() == "\ufffd"


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        IncrementalDetokenizer([], frozenset(), stop=("",))


def test_random_streams_equal_cutting_the_full_text():
    rng = random.Random(0)
    alphabet = "ab \n😀中é<>/"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                       for _ in range(rng.randint(0, 3))})
        # group the bytes into random multi-byte tokens
        data = text.encode()
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 10)))) if data else []
        table = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)] if data else []
        det = IncrementalDetokenizer(table, frozenset(), stop=stops)
        out = "".join(det.push(i) for i in range(len(table))) + det.flush()
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        assert out == (text[:min(hits)] if hits else text), (text, stops, table)
        assert det.stopped == bool(hits)
