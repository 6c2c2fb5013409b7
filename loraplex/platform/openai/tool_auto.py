"""`tool_choice: "auto"` (the default when tools are given): the model decides whether to call one.

- The system text lists the tools and asks for a bare JSON call `{"name", "arguments"}` (or a list of them) when the
  model wants one, and an ordinary answer otherwise; the output is free, not guided.
- An answer that is such a call of a listed tool, as a whole (inside a ```json fence too), becomes
  `message.tool_calls`; anything else is the answer's content, so a model that writes no call, or a broken one, still
  answers.
- Unlike a forced call, an "auto" call's arguments are not held to the tool's schema as they are generated (as with
  OpenAI without `strict`); "required" or a named function gives that.
- Streamed, an answer that opens with `{`, `[` or a fence is held back until it ends (only then is it known to be a
  call); any other answer streams as content at once.
"""

from __future__ import annotations

import json

from loraplex.platform.openai import schemas as s
from loraplex.platform.openai.formatting import ChatFormat, Logprobs
from loraplex.platform.openai.schemas import too_deep

AUTO_PROMPT = ("You can call these functions. To call one, answer with only a JSON object {\"name\": <the "
               "function's name>, \"arguments\": <an object of its parameters>}{several}; to answer without calling "
               "one, answer normally.\n")
SEVERAL = ", or a JSON list of such objects to call several"


def auto_prompt(parallel: bool) -> str:
    """The header of the tools' system text; `parallel_tool_calls: false` leaves out lists of calls."""
    return AUTO_PROMPT.replace("{several}", SEVERAL if parallel else "")
_OPENERS = ("{", "[", "`")


def call_id(rid: str, index: int) -> str:
    """The id of a choice's tool call: choice 0 keeps the request's own."""
    return f"call_{rid}" if index == 0 else f"call_{rid}_{index}"


def _unfenced(body: str) -> str:
    """The inside of a ```json fence that wraps the whole answer, or the answer (string operations,
    linear in its length whatever the model wrote)."""
    if len(body) < 6 or not body.startswith("```") or not body.endswith("```"):
        return body
    inner = body[3:-3]
    return (inner[4:] if inner.startswith("json") else inner).strip()


def parse_calls(text: str, names: frozenset[str], parallel: bool = True) -> list[tuple[str, str]] | None:
    """The answer's calls as (name, arguments as JSON text), or None when it is not wholly a call of
    listed tools (or, without `parallel`, of one)."""
    try:
        value = json.loads(_unfenced(text.strip()))
    except (ValueError, RecursionError):
        return None
    if too_deep(value):
        return None
    calls = value if isinstance(value, list) else [value]
    if len(calls) > 1 and not parallel:
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, dict) or set(call) - {"name", "arguments", "parameters"}:
            return None
        out.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
    return out or None


class AutoToolFormat(ChatFormat):
    """A chat completion whose answer may be tool calls, decided when it ends."""

    def __init__(self, rid: str, created: int, model: str, include_usage: bool = False, logprobs: bool = False,
                 index: int = 0, names: frozenset[str] = frozenset(), parallel: bool = True):
        super().__init__(rid, created, model, include_usage, logprobs, index)
        self.names, self.parallel = names, parallel
        self.call_id = call_id(rid, index)
        self._held = ""  # text not yet sent: leading whitespace, or a whole answer that may be a call
        self._held_logprobs: list = []
        self._streaming_text = False

    def _tool_calls(self, calls: list[tuple[str, str]]) -> list[s.ToolCall]:
        return [s.ToolCall(id=self.call_id if len(calls) == 1 else f"{self.call_id}_{i}",
                           function=s.FunctionCall(name, arguments)) for i, (name, arguments) in enumerate(calls)]

    def delta(self, text: str, logprobs: Logprobs = ()) -> bytes | None:
        if self._streaming_text:
            return super().delta(text, logprobs)
        self._held += text
        self._held_logprobs.extend(logprobs)
        start = self._held.lstrip()
        if not start or start.startswith(_OPENERS):
            return None  # undecided, or possibly a call: held until the answer ends
        self._streaming_text = True
        held, self._held, lps, self._held_logprobs = self._held, "", self._held_logprobs, []
        return super().delta(held, lps)

    def last(self, finish_reason: str) -> bytes:
        held, lps = self._held, self._held_logprobs
        self._held, self._held_logprobs = "", []
        calls = None if self._streaming_text else parse_calls(held, self.names, self.parallel)
        if calls is None:
            head = super().delta(held, lps) if held or lps else b""
            return head + super().last(finish_reason)
        deltas = [s.ToolCallDelta(index=i, id=c.id, type="function",
                                  function=s.FunctionDelta(name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(self._tool_calls(calls))]
        return (self._chunk(s.ChatDelta(tool_calls=deltas), logprobs=self._lp(lps))
                + self._chunk(s.ChatDelta(), "tool_calls"))

    def choice(self, text: str, logprobs: Logprobs, finish_reason: str) -> s.ChatChoice:
        calls = parse_calls(text, self.names, self.parallel)
        if calls is None:
            return super().choice(text, logprobs, finish_reason)
        message = s.AssistantMessage(None, tool_calls=self._tool_calls(calls))
        return s.ChatChoice(self.index, message, "tool_calls", self._lp(logprobs))

