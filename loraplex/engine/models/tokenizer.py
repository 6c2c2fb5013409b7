"""Text <-> token ids for the Llama family, over a Hugging Face `tokenizers.Tokenizer`.

One class serves every source (GGUF metadata, an HF directory, synthetic test models), so the engine
sees the same surface: encode/decode, the ids that end generation, the chat template, and
`token_bytes()`, the exact bytes each id adds to the output, which the incremental detokenizer
needs because a token can end in the middle of a UTF-8 character.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from loraplex.engine.api import InvalidRequestError

if TYPE_CHECKING:
    import gguf

VocabKind = Literal["byte_level", "sentencepiece", "plain"]

# Control tokens that end a turn or a document in the families we serve; whichever the vocab has
# joins the metadata EOS, since GGUF and tokenizer_config name only one.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "</s>", "<|end_of_text|>",
                      "<|end|>", "<end_of_turn>")

# Split regexes (applied before byte-level BPE) as the reference tokenizers define them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_FAMILIES = {
    "gpt2": ("gpt2", "gpt-2", "default"),
    "digits": ("smollm", "starcoder", "refact"),  # every digit alone, then GPT-2's regex
    "llama3": ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"),
    "qwen2": ("qwen2", "deepseek-r1-qwen"),
}
_PRE_BY_NAME = {name: family for family, names in _PRE_FAMILIES.items() for name in names}

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

BYTE_LEVEL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters (byte-level BPE vocabularies use it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs from the model's metadata.

    BOS is added here rather than by a post-processor, so `add_bos` is one explicit switch that
    the catalog can override for files whose metadata is wrong.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, kind: VocabKind, bos_token_id: int | None,
                 eos_token_id: int | None, add_bos: bool, chat_template: str | None,
                 extra_eos_ids: tuple[int, ...] = (), vocab_size: int | None = None):
        self.backend = backend
        self.kind: VocabKind = kind
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), vocab_size or 0)
        added = backend.get_added_tokens_decoder()
        token_at = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
        # Ids with no token at all (padding past the tokenizer) are special too: they decode to nothing.
        unmapped = [i for i in range(self.vocab_size) if i not in token_at]
        self.special_ids = frozenset([i for i, t in added.items() if t.special] + unmapped)
        eos = {eos_token_id} if eos_token_id is not None else set()
        eos |= {i for i in extra_eos_ids if i < self.vocab_size}
        for text in END_OF_TURN_TOKENS:
            tid = backend.token_to_id(text)
            if tid is not None and tid in self.special_ids:
                eos.add(tid)
        self.eos_token_ids = frozenset(eos)
        self.eos_token_id = eos_token_id  # the primary one, which chat templates see as `eos_token`
        self._token_bytes: list[bytes] | None = None
        self._template: tuple[str, jinja2.Template] | None = None

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)}, add_bos={self.add_bos})")

    # ---- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; control tokens written in the text (e.g. "<|im_start|>") map to
        their ids. Text from `apply_chat_template` already holds the BOS its template wants, so
        encode it with add_special_tokens=False. (encode_batch_fast releases the GIL while it works,
        where encode holds it: a long prompt tokenized on a worker thread then stalls no one.)"""
        ids = self.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self) -> list[bytes]:
        """For every id, the bytes it adds to the output text (built once).

        Control tokens give their text; the detokenizer drops them through `special_ids`.
        A SentencePiece word start keeps its space (" Hello"), as it does mid-sequence.
        """
        if self._token_bytes is None:
            added = self.backend.get_added_tokens_decoder()
            out = [b""] * self.vocab_size
            for text, i in self.backend.get_vocab(with_added_tokens=False).items():
                if i < self.vocab_size:
                    out[i] = self._piece_bytes(text)
            for i, tok in added.items():
                if i < self.vocab_size:
                    out[i] = tok.content.encode("utf-8")
            self._token_bytes = out
        return self._token_bytes

    def _piece_bytes(self, piece: str) -> bytes:
        if self.kind == "byte_level":
            table = unicode_to_bytes()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")
        if self.kind == "sentencepiece":
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            return piece.replace("▁", " ").encode("utf-8")
        return piece.encode("utf-8")

    def pad_vocab(self, vocab_size: int) -> None:
        """Grows the id range to the model's embedding rows; the new ids decode to nothing."""
        if vocab_size > self.vocab_size:
            self.special_ids = self.special_ids | frozenset(range(self.vocab_size, vocab_size))
            self.vocab_size = vocab_size
            self._token_bytes = None

    # ---- chat template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Renders `messages` the way transformers' `apply_chat_template(tokenize=False)` does."""
        if not self.chat_template:
            raise InvalidRequestError("model has no chat template", "messages")
        if self._template is None or self._template[0] != self.chat_template:  # compiled once per source
            self._template = (self.chat_template, _compile_template(self.chat_template))
        names = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        special = {k: (self.backend.id_to_token(v) or "") if v is not None else "" for k, v in names.items()}
        try:
            return self._template[1].render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **special, **kwargs)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template: {e}", "messages") from e

    # ---- serialization (the GGUF cache stores this so a cached load skips the metadata parse)

    def to_json(self) -> str:
        return json.dumps({"backend": self.backend.to_str(), "kind": self.kind, "bos": self.bos_token_id,
                           "eos": self.eos_token_id, "extra_eos": sorted(self.eos_token_ids),
                           "add_bos": self.add_bos, "chat_template": self.chat_template,
                           "vocab_size": self.vocab_size})

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        d = json.loads(text)
        return cls(tokenizers.Tokenizer.from_str(d["backend"]), kind=d["kind"], bos_token_id=d["bos"],
                   eos_token_id=d["eos"], extra_eos_ids=tuple(d["extra_eos"]), add_bos=d["add_bos"],
                   chat_template=d["chat_template"], vocab_size=d["vocab_size"])

    # ---- constructors

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, add_bos: bool | None = None) -> Tokenizer:
        """From a GGUF's `tokenizer.ggml.*` metadata; `add_bos` overrides the file's flag."""

        def get(key, default=None):
            field = reader.fields.get(key)
            return field.contents() if field is not None else default

        model = get("tokenizer.ggml.model")
        tokens: list[str] = get("tokenizer.ggml.tokens") or []
        types: list[int] = get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if model == "gpt2":
            backend = _byte_level_bpe(tokens, types, get("tokenizer.ggml.merges") or [],
                                      get("tokenizer.ggml.pre", "default"))
            kind: VocabKind = "byte_level"
        elif model == "llama":
            backend = _sentencepiece_bpe(tokens, types, get("tokenizer.ggml.scores") or [0.0] * len(tokens),
                                         get("tokenizer.ggml.unknown_token_id", 0),
                                         get("tokenizer.ggml.add_space_prefix", True))
            kind = "sentencepiece"
        else:
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported "
                             "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
        if add_bos is None:
            add_bos = bool(get("tokenizer.ggml.add_bos_token", model == "llama"))
        return cls(backend, kind=kind, bos_token_id=get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=get("tokenizer.ggml.eos_token_id"), add_bos=add_bos,
                   chat_template=get("tokenizer.chat_template"), vocab_size=len(tokens))

    @classmethod
    def from_hf_dir(cls, path: str | Path, add_bos: bool | None = None) -> Tokenizer:
        """From tokenizer.json, tokenizer_config.json and generation_config.json in `path`."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        raw = json.loads(tj.read_text(encoding="utf-8"))
        backend = tokenizers.Tokenizer.from_file(str(tj))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        bos = _token_id(backend, cfg.get("bos_token"))
        eos = _token_id(backend, cfg.get("eos_token"))
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        if add_bos is None:
            add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # ask the post-processor whether it prepends BOS
            add_bos = bos is not None and backend.encode("a").ids[:1] == [bos]
        decoder = json.dumps(raw.get("decoder")) + json.dumps(raw.get("pre_tokenizer"))
        if "ByteLevel" in decoder:
            kind: VocabKind = "byte_level"
        elif "ByteFallback" in decoder or "Metaspace" in decoder or raw.get("model", {}).get("byte_fallback"):
            kind = "sentencepiece"
        else:
            kind = "plain"
        return cls(backend, kind=kind, bos_token_id=bos, eos_token_id=eos if eos is not None else
                   (gen_eos[0] if gen_eos else None), extra_eos_ids=tuple(gen_eos), add_bos=bool(add_bos),
                   chat_template=template)

    @classmethod
    def byte_level(cls, vocab_size: int) -> Tokenizer:
        """Synthetic test tokenizer: ids 0..255 are bytes, 256..258 are <|endoftext|>,
        <|im_start|>, <|im_end|>; ids up to vocab_size are unused. ChatML template."""
        specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
        if vocab_size < 256 + len(specials):
            raise ValueError(f"byte-level tokenizer needs vocab_size >= 259, got {vocab_size}")
        vocab = {c: b for b, c in bytes_to_unicode().items()}
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        return cls(backend, kind="byte_level", bos_token_id=None, eos_token_id=256, add_bos=False,
                   chat_template=BYTE_LEVEL_CHAT_TEMPLATE, vocab_size=vocab_size)


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    family = _PRE_BY_NAME.get(pre)
    if family is None:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {sorted(_PRE_BY_NAME)})")
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    vocab: dict[str, int] = {}
    for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty == _NORMAL and not set(tok) <= alphabet:  # a few files store raw text; respell it
            tok = "".join(spell[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=family == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family in ("gpt2", "digits"))
    if family == "digits":
        digits = pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    elif family == "gpt2":
        backend.pre_tokenizer = byte_level
    else:
        split = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
        if family == "qwen2":
            backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    _add_gguf_specials(backend, tokens, types)
    return backend


def _sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float], unk_id: int,
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """Llama 2 / Mistral style: BPE with byte fallback. GGUF keeps scores, not merges, so merges
    are rebuilt: every split of a normal piece into two known pieces, best piece score first."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    ranked = []
    for tok, i in vocab.items():
        if types[i] != _NORMAL:
            continue
        for k in range(1, len(tok)):
            left, right = vocab.get(tok[:k]), vocab.get(tok[k:])
            if left is not None and right is not None:
                ranked.append((-scores[i], left, right))
    ranked.sort()
    merges = [(tokens[a], tokens[b]) for _, a, b in ranked]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id],
                                              byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    _add_gguf_specials(backend, tokens, types)
    return backend


def _add_gguf_specials(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens, so
    either written in text encodes to its own id instead of being split into pieces."""
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=True) if ty in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_id(backend: tokenizers.Tokenizer, token) -> int | None:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML; chat templates expect plain JSON (as transformers renders it).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
