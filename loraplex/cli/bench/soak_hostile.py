"""The hostile requests of issue 36, as a tenant with one valid key would send them: each is built
once (the bodies run to megabytes) and sent again and again by its own client during the soak's
hostile phase."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Hostile:
    """One kind of hostile request: where it goes, with which key, and its body (bytes, built once)."""

    kind: str
    path: str
    body: bytes | None
    bad_key: bool = False  # sent with a fresh invalid key each time, not the hostile tenant's

    @property
    def method(self) -> str:
        """GET without a body, else POST."""
        return "GET" if self.body is None else "POST"


def _chat(model: str, content: str, **extra) -> bytes:
    """A chat completion body."""
    return json.dumps({"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": content}],
                       **extra}).encode()


def recursive_alternatives_schema() -> dict:
    """Two identical recursive array alternatives: a naive matcher doubles its state on every `[`."""
    alt = {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/x"}}
    return {"$defs": {"x": {"anyOf": [alt, dict(alt)]}}, "$ref": "#/$defs/x"}


def nested_schema(depth: int) -> dict:
    """An object schema `depth` levels deep (a recursive walk of it overflows Python's stack)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _tool_turns(arguments: str) -> list[dict]:
    """A conversation whose assistant turn called a tool with `arguments`."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "call f"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}]


def hostile_requests(model: str) -> list[Hostile]:
    """Every kind, against the served base model `model` (and `auto`)."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": recursive_alternatives_schema()}}
    enum = {"type": "string", "enum": [f"v{i}" for i in range(300_000)]}
    enum_format = {"type": "json_schema", "json_schema": {"name": "e", "schema": enum}}
    # as many values as fit well under a 2 MB body limit, so the grammar engine's own bounds meet it
    small_enum = {"type": "string", "enum": [f"{i:x}" for i in range(150_000)]}
    small_enum_format = {"type": "json_schema", "json_schema": {"name": "e", "schema": small_enum}}
    deep_format = {"type": "json_schema", "json_schema": {"name": "d", "schema": nested_schema(300)}}
    whitespace = ("\n" + " " * 31) * 1024  # 32k characters of newlines and spaces
    return [
        Hostile("recursive_schema", "/v1/chat/completions", _chat(model, "[", response_format=schema_format)),
        Hostile("enum_300k", "/v1/chat/completions", _chat(model, "pick", response_format=enum_format)),
        Hostile("enum_150k_under_body_limit", "/v1/chat/completions",
                _chat(model, "pick", response_format=small_enum_format)),
        Hostile("schema_nested_300", "/v1/chat/completions", _chat(model, "go", response_format=deep_format)),
        Hostile("tool_arguments_deep", "/v1/chat/completions",
                json.dumps({"model": model, "max_tokens": 16, "messages": _tool_turns("[" * 50_000)}).encode()),
        Hostile("prompt_9mb", "/v1/chat/completions", _chat(model, "a " * 4_500_000)),
        Hostile("logit_bias_5000", "/v1/chat/completions",
                _chat(model, "hi", logit_bias={str(i): 1.0 for i in range(5000)})),
        Hostile("logit_bias_duplicate_keys", "/v1/chat/completions",
                _chat(model, "hi", logit_bias={"0" * k + "1": 1.0 for k in range(1, 400)})),
        Hostile("auto_whitespace_32k", "/v1/chat/completions", _chat("auto", whitespace)),
        Hostile("model_name_1mb", "/v1/chat/completions", b""),  # the name is made fresh for each send
        Hostile("usage_period_year_0", "/v1/usage?period=0000-01", None),
        Hostile("usage_period_overflow", "/v1/usage?period=9999-12-31", None),
        Hostile("bad_key", "/v1/models", None, bad_key=True),
    ]


def body_for(h: Hostile, model: str) -> bytes | None:
    """The body to send now: the 1 MB unknown model name differs every time (a cache keyed by it must
    not keep them)."""
    if h.kind == "model_name_1mb":
        name = secrets.token_hex(8).encode() + _MS
        return b'{"model": "' + name + b'", "messages": [{"role": "user", "content": "hi"}]}'
    return h.body


_MS = b"m" * 1_000_000


def bad_key() -> str:
    """A made-up key in the real keys' format."""
    return "lpx-" + secrets.token_urlsafe(32)
