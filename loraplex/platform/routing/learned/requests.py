"""What a scorer reads from a request (`RequestText`), from the engine's prompt fields or a JSON line.

- The last user turn's text, the whole conversation's size in characters, its turns (system turns
  not counted) and max_tokens.
- JSON lines (`loraplex models score --input`, `router train`): `{"prompt": str}` or
  `{"messages": [{"role", "content"}]}` (content a string or a list of text parts), optional
  `max_tokens`; each read at most MAX_LINE_BYTES, and anything else is one `BadLine` naming the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO

from loraplex.platform.routing.complexity import RequestText

MAX_LINE_BYTES = 4 << 20
MAX_LINES = 1_000_000
MAX_MESSAGES = 10_000


class BadLine(ValueError):
    """A JSON line that is not a request (its message names the line and what is wrong)."""


def request_text(prompt: dict, max_tokens: int | None) -> RequestText:
    """What the score reads from the engine request's prompt fields: chat `messages`, a `prompt`
    string, or `prompt_token_ids` (no text to read: about 4 characters a token for its length)."""
    if "messages" in prompt:
        messages = prompt["messages"]
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return RequestText(last_user, sum(len(m["content"]) for m in messages),
                           sum(1 for m in messages if m["role"] != "system"), max_tokens)
    if "prompt" in prompt:
        return RequestText(prompt["prompt"], len(prompt["prompt"]), 1, max_tokens)
    return RequestText("", 4 * len(prompt["prompt_token_ids"]), 1, max_tokens)


def _content(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in value):
        return "".join(p.get("text", "") for p in value)
    raise ValueError("a message's content must be a string or a list of text parts")


def parse_request(obj) -> RequestText:
    """A JSON object's request (module docstring); ValueError says what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or not 1 <= max_tokens <= 10_000_000):
        raise ValueError("max_tokens must be an integer from 1 to 10000000")
    if isinstance(obj.get("prompt"), str):
        return request_text({"prompt": obj["prompt"]}, max_tokens)
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise ValueError(f"needs a string 'prompt' or 'messages', a list of 1 to {MAX_MESSAGES} messages")
    turns = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message needs a string 'role'")
        turns.append({"role": m["role"], "content": _content(m.get("content", ""))})
    return request_text({"messages": turns}, max_tokens)


def json_lines(stream: IO[bytes], max_lines: int = MAX_LINES) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; BadLine for a line too long, not JSON or not
    an object, or past max_lines."""
    number = 0
    while True:
        raw = stream.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise BadLine(f"line {number}: longer than {MAX_LINE_BYTES} bytes")
        if not raw.strip():
            continue
        if number > max_lines:
            raise BadLine(f"line {number}: more than {max_lines} lines")
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise BadLine(f"line {number}: not JSON ({str(exc)[:80]})") from None
        if not isinstance(obj, dict):
            raise BadLine(f"line {number}: not a JSON object")
        yield number, obj


def read_requests(stream: IO[bytes], max_lines: int = MAX_LINES) -> Iterator[RequestText]:
    """The requests of a JSON-lines stream, in order."""
    for number, obj in json_lines(stream, max_lines):
        try:
            yield parse_request(obj)
        except ValueError as exc:
            raise BadLine(f"line {number}: {exc}") from None
