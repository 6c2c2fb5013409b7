"""OpenAI request fields -> the engine's GenerateRequest parts, checked against schemas.py's limits."""

from __future__ import annotations

import json
import re

from loraplex.engine.api import MAX_LOGPROBS, SamplingParams
from loraplex.platform.errors import invalid, shown
from loraplex.platform.openai import schemas as s
from loraplex.platform.openai import tool_calls
from loraplex.platform.openai.schemas import too_deep

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat has none
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI's JSON mode: the output is one JSON object
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # canonical: "1", never "01", "+1", " 1" or "1.0"


def check_supported(data: s.ChatCompletionRequest | s.CompletionRequest) -> None:
    if not 1 <= data.n <= s.MAX_CHOICES:
        raise invalid(f"n must be in [1, {s.MAX_CHOICES}], got {data.n}", "n")
    best_of = getattr(data, "best_of", None)
    if best_of is not None:
        if not data.n <= best_of <= s.MAX_CHOICES:
            raise invalid(f"best_of must be in [n, {s.MAX_CHOICES}] (n is {data.n}), got {best_of}", "best_of")
        if data.stream and best_of > data.n:
            raise invalid("best_of cannot be streamed: the best choices are known only at the end", "best_of")
    if data.stream_options is not None and not data.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")


def generated_choices(data: s.ChatCompletionRequest | s.CompletionRequest) -> int:
    """How many choices the engine generates: best_of when given (the best n are returned), else n."""
    return getattr(data, "best_of", None) or data.n


def sampling(data: s.ChatCompletionRequest | s.CompletionRequest, max_tokens: int | None) -> SamplingParams:
    stop = data.stop
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > s.MAX_STOP:
        raise invalid(f"stop may have at most {s.MAX_STOP} sequences, got {len(stops)}", "stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if data.temperature is None else data.temperature,
        top_p=1.0 if data.top_p is None else data.top_p,
        top_k=max(0, data.top_k or 0),  # (-1 is vLLM's "off", as 0 is)
        min_p=data.min_p or 0.0,
        seed=data.seed,
        presence_penalty=data.presence_penalty or 0.0,
        frequency_penalty=data.frequency_penalty or 0.0,
        stop=stops,
        ignore_eos=data.ignore_eos,
        json_schema=json_schema(data.response_format),
        logprobs=_engine_logprobs(data),
        prompt_logprobs=echo_logprobs(data),
        logit_bias=logit_bias(data.logit_bias))


def echo_logprobs(data: s.ChatCompletionRequest | s.CompletionRequest) -> int | None:
    """What an echo needs of the prompt's log-probabilities: as many alternatives as the completion's
    when it asks for logprobs, the tokens alone (k = 0) to echo a prompt given as token ids, else none."""
    if not isinstance(data, s.CompletionRequest) or not data.echo:
        return None
    if data.logprobs is not None and not isinstance(data.logprobs, bool):
        return data.logprobs
    return None if "prompt" in completion_prompt(data) else 0


def echo_text(data: s.CompletionRequest) -> str | bool | None:
    """The text an echo puts first: the prompt string, True to take it from the prompt's tokens, or None."""
    if not data.echo:
        return None
    prompt = completion_prompt(data)
    return prompt.get("prompt", True)


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (JSON keys) to biases, at most MAX_LOGIT_BIAS of them. A key must be
    written canonically, so one token cannot be biased twice under two spellings; the engine checks
    that the ids exist and the range."""
    if bias is not None and len(bias) > s.MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias may have at most {s.MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    out = []
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise invalid(f"logit_bias keys must be token ids written as plain decimal integers, got "
                          f"{shown(key)!r}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def _engine_logprobs(data: s.ChatCompletionRequest | s.CompletionRequest) -> int | None:
    """What the engine reports: what the caller asked for, and at least each token's own when best_of
    must rank the choices by it."""
    asked = logprobs(data)
    return (asked or 0) if generated_choices(data) > data.n else asked


def logprobs(data: s.ChatCompletionRequest | s.CompletionRequest) -> int | None:
    """How many alternatives per generated token, or None for no log-probabilities. Chat asks with
    `logprobs: true` and `top_logprobs: k`; text completions with `logprobs: k` (the engine checks k)."""
    asked = data.logprobs
    if isinstance(data, s.ChatCompletionRequest):
        if asked is not None and not isinstance(asked, bool):
            raise invalid("logprobs must be true or false; top_logprobs says how many alternatives", "logprobs")
        if data.top_logprobs is not None and not asked:
            raise invalid("top_logprobs requires logprobs: true", "top_logprobs")
        if not asked:
            return None
        if data.top_logprobs is not None and not 0 <= data.top_logprobs <= MAX_LOGPROBS:
            raise invalid(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {data.top_logprobs}", "top_logprobs")
        return data.top_logprobs or 0
    if isinstance(asked, bool):
        raise invalid("logprobs must be an integer on /v1/completions: the alternatives per token", "logprobs")
    return asked


def json_schema(fmt: s.ResponseFormat | None) -> str | None:
    """response_format -> the schema text the engine holds the output to (None: free text). The
    engine compiles it and refuses what it cannot enforce (param response_format)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    if fmt.json_schema is None:
        raise invalid("response_format.json_schema is required when type is json_schema", "response_format")
    schema = fmt.json_schema.schema
    if too_deep(schema):
        raise invalid(f"response_format's schema nests more than {s.MAX_JSON_DEPTH} levels deep", "response_format")
    return json.dumps(True if schema is None else schema)  # declared key order kept: it is the output's


def chat_max_tokens(data: s.ChatCompletionRequest) -> int | None:
    return data.max_completion_tokens if data.max_completion_tokens is not None else data.max_tokens


def completion_max_tokens(data: s.CompletionRequest) -> int:
    return COMPLETIONS_DEFAULT_MAX_TOKENS if data.max_tokens is None else data.max_tokens


def chat_messages(data: s.ChatCompletionRequest) -> tuple[dict, ...]:
    """Messages as the chat template wants them; content parts other than text are refused. Earlier
    tool calls are written back as the model was asked to write them (tool_calls.py), and a tool's
    result becomes a user turn that names its call, which every chat template can render."""
    out = []
    for i, m in enumerate(data.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise invalid("only text content parts are supported", f"messages[{i}].content")
            content = "".join(p.text for p in content)
        content = content or ""
        role = {"developer": "system", "tool": "user"}.get(m.role, m.role)
        if m.role == "tool":
            content = f"Result of function call {m.tool_call_id or ''}:\n{content}"
        if m.tool_calls:
            calls = [tool_calls.call_text(c, f"messages[{i}].tool_calls[{j}].function.arguments")
                     for j, c in enumerate(m.tool_calls)]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    return tuple(out)


def completion_prompt(data: s.CompletionRequest) -> dict:
    """A string, a list of one string, or a list of token ids."""
    prompt = data.prompt
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return {"prompt_token_ids": tuple(prompt)}
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return {"prompt": prompt[0]}
    raise invalid("prompt must be a string, a list of one string, or a list of token ids", "prompt")
