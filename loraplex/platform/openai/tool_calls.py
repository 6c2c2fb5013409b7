"""Tool calling: `tools` with `tool_choice` "required" or a named function, held exact by guided
decoding; "auto" (the default with tools) in tool_auto.py.

A forced call is a JSON Schema like any other. The model answers `{"name": ..., "arguments": {...}}`,
constrained to the candidate tools' names and each one's parameters schema (`$ref`s rebased under one
root), after a system message that lists the tools. The answer becomes `message.tool_calls`;
streamed, the name comes in one delta and the arguments' text in pieces as it is generated. (A
model family's own tool-call format is not parsed: the server asks every model for the same JSON.)
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from msgspec import UNSET

from loraplex.platform.errors import invalid, shown
from loraplex.platform.openai import schemas as s
from loraplex.platform.openai.formatting import ChatFormat, Logprobs
from loraplex.platform.openai.schemas import too_deep
from loraplex.platform.openai.tool_auto import AutoToolFormat, auto_prompt, call_id

TOOLS_PROMPT = ("Call one of these functions. Answer with a JSON object {\"name\": <the function's name>, "
                "\"arguments\": <an object of its parameters>} and nothing else.\n")
NO_PARAMETERS = {"type": "object", "additionalProperties": False}
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names (matched whole)
# The call's text up to its arguments' first character (which must have come: whitespace before it may grow)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass(frozen=True)
class ToolPlan:
    schema: str | None  # the JSON Schema text of a forced call; None: "auto", the output is free
    prompt: str  # the system text that lists the tools
    names: frozenset[str] = frozenset()
    parallel: bool = True  # "auto": an answer may call several tools

    def format_class(self):
        """The response format of this request's choices."""
        if self.schema is None:
            return functools.partial(AutoToolFormat, names=self.names, parallel=self.parallel)
        return ToolCallFormat


def plan(data: s.ChatCompletionRequest) -> ToolPlan | None:
    """The tool call this request asks for (forced, or "auto"), or None for a plain answer; 400s for what
    cannot be served."""
    for name in ("functions", "function_call"):
        if getattr(data, name):
            raise invalid(f"the deprecated {name} is not supported: use tools with tool_choice", name)
    choice, tools = data.tool_choice, data.tools or []
    if not tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in tools]
    bad = next((n for n in names if not _NAME.fullmatch(n)), None)
    if bad is not None:
        raise invalid(f"function names are 1-64 letters, digits, '_' or '-', got {shown(bad)!r}", "tools")
    if len(set(names)) != len(names):
        raise invalid("function names must be unique", "tools")
    check_parameters(tools)
    if data.response_format is not None and data.response_format.type != "text":
        raise invalid("response_format cannot be combined with tools (unless tool_choice is none)", "response_format")
    if choice in (None, "auto"):
        parallel = data.parallel_tool_calls is not False
        return ToolPlan(None, _prompt(auto_prompt(parallel), tools), frozenset(names), parallel)
    if isinstance(choice, s.ToolChoiceFunction):
        if choice.function.name not in names:
            raise invalid(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
        candidates = [t for t in tools if t.function.name == choice.function.name]
    else:
        candidates = tools
    if data.stop:  # a stop string could end the call mid-JSON, where "stop" must mean a whole call
        raise invalid("stop cannot be combined with a forced tool call", "stop")
    return ToolPlan(json.dumps(call_schema(candidates), ensure_ascii=False), _prompt(TOOLS_PROMPT, tools),
                    frozenset(names))


def check_parameters(tools: list[s.Tool]) -> None:
    """The tools' parameters within schemas.py's limits on nesting and size, before anything walks them."""
    size = 0
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        if too_deep(params):
            raise invalid(f"the parameters of tools[{i}] nest more than {s.MAX_JSON_DEPTH} levels deep", "tools")
        size += len(json.dumps(params, ensure_ascii=False).encode())
        if size > s.MAX_TOOLS_SCHEMA_BYTES:
            raise invalid(f"the tools' parameters take more than {s.MAX_TOOLS_SCHEMA_BYTES} bytes as JSON", "tools")


def call_schema(tools: list[s.Tool]) -> dict:
    """`{"name": <one of the tools>, "arguments": <its parameters>}` as one JSON Schema document: each
    tool's parameters (and their `$defs`) move under `$defs`, their `$ref`s rewritten to follow."""
    defs: dict = {}
    alternatives = []
    for i, tool in enumerate(tools):
        prefix = f"tool{i}"
        params = tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS
        if not isinstance(params, dict):
            raise invalid(f"the parameters of {tool.function.name!r} must be a JSON Schema object", "tools")
        for key in ("$defs", "definitions"):
            for name, sub in (params.get(key) or {}).items():
                defs[f"{prefix}.{name}"] = _rebase(sub, prefix)
        defs[prefix] = _rebase(params, prefix)
        alternatives.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                             "properties": {"name": {"const": tool.function.name},
                                            "arguments": {"$ref": f"#/$defs/{prefix}"}}})
    root = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {**root, "$defs": defs}


def _rebase(node, prefix: str):
    """A copy of a tool's schema whose `$ref`s point where call_schema moved their targets."""
    if isinstance(node, list):
        return [_rebase(x, prefix) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("$defs", "definitions"):
            continue
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            parts = value[1:].split("/", 3)  # "", "$defs", name, rest
            if len(parts) >= 3 and parts[1] in ("$defs", "definitions"):
                value = f"#/$defs/{prefix}.{parts[2]}" + (f"/{parts[3]}" if len(parts) > 3 else "")
            else:
                value = f"#/$defs/{prefix}{value[1:]}"
        out[key] = _rebase(value, prefix)
    return out


def _prompt(header: str, tools: list[s.Tool]) -> str:
    listed = [{"name": t.function.name, "description": t.function.description,
               "parameters": t.function.parameters if t.function.parameters is not None else NO_PARAMETERS}
              for t in tools]
    return header + "\n".join(json.dumps(t, ensure_ascii=False) for t in listed)


def with_prompt(messages: tuple[dict, ...], tools_plan: ToolPlan) -> tuple[dict, ...]:
    """The tools' system text before the conversation (after the caller's own system text, if any)."""
    if messages and messages[0]["role"] == "system":
        first = {"role": "system", "content": f"{messages[0]['content']}\n\n{tools_plan.prompt}"}
        return (first, *messages[1:])
    return ({"role": "system", "content": tools_plan.prompt}, *messages)


def call_text(call: s.ToolCall, param: str = "messages") -> str:
    """An earlier assistant turn's call, written back as the model was asked to write it. Arguments
    that are not JSON are kept as their text; JSON nested past MAX_JSON_DEPTH is refused (`param`)."""
    deep = invalid(f"tool call arguments nest more than {s.MAX_JSON_DEPTH} levels deep", param)
    try:
        arguments = json.loads(call.function.arguments)
    except RecursionError:
        raise deep from None
    except ValueError:
        arguments = call.function.arguments
    if too_deep(arguments):
        raise deep
    return json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)


class CallText:
    """Follows the generated call's text and splits it into the function name and the arguments' text.
    Streaming holds back trailing whitespace and one "}", which may be the wrapper's own close."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self._start = 0
        self.sent = 0  # characters of the arguments already given out

    def push(self, text: str) -> tuple[str | None, str]:
        """(the name, the first time it is known; the arguments' text that is now certain). Text of
        whitespace alone makes nothing certain: it returns at once, so however much whitespace a
        model writes, the call's text is not scanned again for each piece of it."""
        self.text += text
        if not text.strip():
            return None, ""
        named = None
        if self.name is None:
            head = _HEAD.match(self.text)
            if head is None:
                return None, ""
            self.name = named = json.loads(head.group(1))
            self._start = head.end()
        safe = self.text[self._start:].rstrip()
        if safe.endswith("}"):
            safe = safe[:-1].rstrip()
        return named, self._take(len(safe))

    def finish(self, complete: bool) -> str:
        """The rest of the arguments' text: without the wrapper's close when the call is complete."""
        if self.name is None:
            return ""
        args = self.text[self._start:]
        if complete:
            args = args.rstrip()[:-1].rstrip()
        return self._take(len(args))

    @classmethod
    def parse(cls, text: str, complete: bool) -> tuple[str | None, str]:
        """A whole answer's (function name, arguments' text); (None, "") when it was cut before both."""
        call = cls()
        call.push(text)
        call.finish(complete)
        return call.name, call.text[call._start:call._start + call.sent]

    def _take(self, end: int) -> str:
        piece = self.text[self._start + self.sent:self._start + end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


class ToolCallFormat(ChatFormat):
    """A chat completion whose answer is one tool call."""

    def __init__(self, rid: str, created: int, model: str, include_usage: bool = False, logprobs: bool = False,
                 index: int = 0):
        super().__init__(rid, created, model, include_usage, logprobs, index)
        self.call_id = call_id(rid, index)
        self._call = CallText()

    def _call_chunk(self, name: str | None, arguments: str, logprobs: Logprobs = ()) -> bytes | None:
        if name is None and not arguments and not logprobs:
            return None
        delta = s.ToolCallDelta(index=0, function=s.FunctionDelta(arguments=arguments))
        if name is not None:
            delta = s.ToolCallDelta(index=0, id=self.call_id, type="function",
                                    function=s.FunctionDelta(name=name, arguments=arguments))
        return self._chunk(s.ChatDelta(tool_calls=[delta]), logprobs=self._lp(logprobs))

    def delta(self, text: str, logprobs: Logprobs = ()) -> bytes | None:
        return self._call_chunk(*self._call.push(text), logprobs)

    def last(self, finish_reason: str) -> bytes:
        rest = self._call.finish(finish_reason == "stop")
        tail = self._call_chunk(None, rest) or b""
        return tail + self._chunk(s.ChatDelta(), "tool_calls" if finish_reason == "stop" else finish_reason)

    def choice(self, text: str, logprobs: Logprobs, finish_reason: str) -> s.ChatChoice:
        name, arguments = CallText.parse(text, finish_reason == "stop")
        calls = [s.ToolCall(id=self.call_id, function=s.FunctionCall(name, arguments))] if name else UNSET
        message = s.AssistantMessage(None if name else text, tool_calls=calls)
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return s.ChatChoice(self.index, message, reason, self._lp(logprobs))
