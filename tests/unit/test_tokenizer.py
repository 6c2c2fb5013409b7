"""Tokenizer: GGUF-built ones agree with transformers; byte-level and HF-dir constructors; chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from loraplex.engine.api import InvalidRequestError
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.models.loader import resolve_model
from loraplex.engine.models.tokenizer import Tokenizer, bytes_to_unicode

TEXTS = [
    "Hello world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n\n\tpass",
    "12345 and 3.14159, 1e-10, 0xFF; 2024-01-31",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 and a flag 🇫🇷",
    "中文文本，日本語のテキスト。한국어 텍스트",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces, trailing spaces   \r\n\n  ",
    "naïve café résumé — “quotes” ∑ ∞",
    "<repo_name>owner/repo<file_sep>main.py",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Say 😀 in 中文"}],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return Path(resolve_model("smollm2-135m").path)


@pytest.fixture(scope="module")
def ours(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(gguf_path)))


@pytest.fixture(scope="module")
def theirs(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


# ---- the default model's GGUF tokenizer against transformers' GGUF tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers(ours, theirs, text):
    # Both add no BOS for this file (add_bos_token is false in its metadata), so the default
    # add_special_tokens=True is compared as is.
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_decode_round_trips(ours, theirs, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text == theirs.decode(ids)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_gguf_smollm_splits_every_numeric_char_unlike_transformers(ours, theirs):
    # SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) isolate every numeric
    # character before the GPT-2 regex; transformers' GGUF loader skips that step. ASCII digits
    # tokenize the same either way (the vocab has no multi-digit tokens), but " ½" does not.
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    text = "costs ½ of 12345, x² ⅔"
    assert ours.encode(text) != theirs.encode(text)
    fixed = Backend.from_str(theirs.backend_tokenizer.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                   fixed.pre_tokenizer])
    assert ours.encode(text) == fixed.encode(text).ids


@pytest.mark.slow
def test_gguf_metadata(ours):
    assert ours.vocab_size == 49152 and ours.kind == "byte_level"
    assert ours.bos_token_id == 1 and not ours.add_bos
    assert ours.eos_token_ids == {0, 2}  # <|endoftext|>, <|im_end|> (metadata eos)
    assert ours.special_ids == set(range(17))  # the 17 control tokens, <|endoftext|> .. <empty_output>
    assert ours.encode("<|im_start|>") == [1]
    assert Tokenizer.from_json(ours.to_json()).encode(TEXTS[5]) == ours.encode(TEXTS[5])


@pytest.mark.slow
@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, add_generation_prompt):
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == want
    assert ours.encode(got, add_special_tokens=False) == theirs.encode(want, add_special_tokens=False)


@pytest.mark.slow
def test_token_bytes_concatenate_to_decoded_text(ours):
    table = ours.token_bytes()
    assert table is ours.token_bytes() and len(table) == 49152
    for text in TEXTS:
        ids = ours.encode(text)
        visible = [i for i in ids if i not in ours.special_ids]
        assert b"".join(table[i] for i in visible).decode("utf-8") == ours.decode(ids)


@pytest.mark.slow
def test_streaming_detokenizer_equals_decode(ours):
    for text in TEXTS:
        ids = ours.encode(text)
        det = IncrementalDetokenizer(ours.token_bytes(), ours.special_ids)
        pieces = [det.push(i) for i in ids] + [det.flush()]
        assert "".join(pieces) == ours.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


# ---- small GGUFs written here: pre-tokenizers, SentencePiece vocabularies, unsupported files


def _write_gguf(path: Path, model: str, tokens: list[str], types: list[int], pre: str | None = None,
                scores: list[float] | None = None, merges: list[str] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _byte_vocab() -> list[str]:
    return ["<|endoftext|>", "<s>", "</s>"] + [bytes_to_unicode()[b] for b in range(256)]


@pytest.mark.parametrize("pre, text, pieces", [
    ("smollm", "ab 1234", ["ab", "Ġ", "1", "2", "3", "4"]),
    ("gpt2", "ab 1234", ["ab", "Ġ1234"]),
    ("llama-bpe", "ab 1234567", ["ab", "Ġ", "123", "456", "7"]),
    ("qwen2", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
])
def test_gguf_pre_tokenizers(tmp_path, pre, text, pieces):
    path = _write_gguf(tmp_path / "t.gguf", "gpt2", _byte_vocab(), [3, 3, 3] + [1] * 256, pre=pre, merges=[])
    tok = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)] == pieces
    assert tok.decode(tok.encode(text)) == text


def test_gguf_unsupported_tokenizers_are_value_errors(tmp_path):
    path = _write_gguf(tmp_path / "a.gguf", "gpt2", _byte_vocab(), [3, 3, 3] + [1] * 256, pre="klingon")
    with pytest.raises(ValueError, match="pre-tokenizer 'klingon'"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    path = _write_gguf(tmp_path / "b.gguf", "bert", ["[CLS]", "a"], [3, 1])
    with pytest.raises(ValueError, match="tokenizer model 'bert'"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


def test_gguf_sentencepiece_matches_transformers(tmp_path):
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "s", "▁h", "he", "ll", "llo", "▁he", "▁hello", "▁w",
             "or", "▁wor", "ld", "▁world", "▁t", "es", "▁tes", "▁test", "st", "lo", "el", "hel"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    path = _write_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    assert ours.kind == "sentencepiece" and ours.add_bos and ours.eos_token_ids == {2}
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    # Texts start without a space and hold no control tokens: there transformers 5 (Metaspace,
    # prepend "first") leaves out the word-start "▁" that SentencePiece and llama.cpp add.
    for text in ["hello world", "hello  test", "héllo wörld 😀", "hellotest", "\n x"]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    table = ours.token_bytes()
    assert table[3 + 0xC3] == b"\xc3" and table[tokens.index("▁hello")] == b" hello"
    # the same vocabulary as an HF directory is recognised as SentencePiece-style
    (tmp_path / "hf").mkdir()
    ours.backend.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    hf = Tokenizer.from_hf_dir(tmp_path / "hf")
    assert hf.kind == "sentencepiece" and hf.token_bytes() == table
    # no add_bos_token in the config: the post-processor (none here) decides, so no BOS
    assert hf.encode("héllo world") == ours.encode("héllo world")[1:]


# ---- constructors without a GGUF


def test_byte_level_tokenizer():
    tok = Tokenizer.byte_level(512)
    assert tok.vocab_size == 512 and tok.bos_token_id is None and not tok.add_bos
    assert tok.encode("hi é") == [104, 105, 32, 0xC3, 0xA9]
    assert tok.encode("<|im_start|>x<|im_end|>") == [257, 120, 258]
    assert tok.eos_token_ids == {256, 258}
    assert tok.special_ids == {256, 257, 258} | set(range(259, 512))
    table = tok.token_bytes()
    assert len(table) == 512 and table[0xC3] == b"\xc3"
    assert table[257] == b"<|im_start|>" and table[300] == b""
    assert tok.decode([104, 105, 258, 300]) == "hi"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError):
        Tokenizer.byte_level(100)


def test_from_hf_dir(tmp_path):
    Tokenizer.byte_level(259).backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|endoftext|>", "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{{ eos_token }}",
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 258]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.kind == "byte_level" and tok.bos_token_id == 257 and tok.add_bos
    assert tok.encode("a") == [257, 97] and tok.encode("a", add_special_tokens=False) == [97]
    assert tok.eos_token_ids == {256, 258}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|endoftext|>"
    assert not Tokenizer.from_hf_dir(tmp_path, add_bos=False).add_bos
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "nowhere")


def test_chat_template_errors_and_filters():
    tok = Tokenizer.byte_level(259)
    tok.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template") as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert e.value.param == "messages"
    tok = Tokenizer.byte_level(259)
    tok.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                         "{% endif %}ok")
    with pytest.raises(InvalidRequestError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    tok = Tokenizer.byte_level(259)
    tok.chat_template = "  {% for m in messages %}\n{{ m | tojson }}\n{% endfor %}"
    # tojson keeps non-ASCII and HTML as is; trim_blocks/lstrip_blocks drop the block lines' whitespace.
    assert tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}]) == (
        '{"role": "user", "content": "<b>é</b>"}\n')
    for evil in ("{{ ''.__class__.__mro__ }}", "{{ messages.append(1) }}"):  # sandboxed and immutable
        tok.chat_template = evil  # (also checks that a changed template is recompiled)
        with pytest.raises(InvalidRequestError, match="unsafe"):
            tok.apply_chat_template([])
