"""OpenAI request and response bodies as msgspec structs (validated by Litestar, shown in /schema).

Fields OpenAI has and we do not use are accepted and ignored, as OpenAI-compatible servers do;
fields whose meaning we cannot honour (the deprecated functions) are refused with a 400.

What one request may carry is bounded by the limits below, OpenAI's where it documents them, each
a 400 naming its field: the counts and lengths as the body is decoded (they show in /schema), the
rest where the field is read (openai_convert.py, tool_calls.py). The body as a whole is bounded by
LORAPLEX_MAX_BODY_BYTES (413).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from loraplex.engine.api import MAX_LOGIT_BIAS

MAX_MESSAGES = 2048  # OpenAI's
MAX_TEXT_CHARS = 10 << 20  # a message's content, a text part, a prompt, a call's arguments: OpenAI's 10 MiB
MAX_CONTENT_PARTS = 1024  # text parts of one message
MAX_TOOLS = 128  # OpenAI's
MAX_TOOL_CALLS = 128  # calls in one earlier assistant turn
MAX_TOOLS_SCHEMA_BYTES = 256 << 10  # the tools' parameters together, as JSON text
MAX_STOP = 4  # OpenAI's
MAX_STOP_CHARS = 1024  # one stop string
# MAX_LOGIT_BIAS (engine.api): OpenAI's 300; keys are token ids written canonically ("1", not "01")
MAX_CHOICES = 16  # n and best_of: each choice is a sequence in the engine's batch
MAX_JSON_DEPTH = 64  # nesting of a tool's parameters, a response_format schema, a call's arguments

NonNegInt = Annotated[int, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
StopText = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]


class ContentPart(Struct):
    type: str
    text: Text | None = None


class FunctionCall(Struct):
    name: str
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct):
    role: str
    content: Text | Annotated[list[ContentPart], Meta(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOL_CALLS)] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class FunctionDef(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema; None: no parameters
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Struct):
    name: str


class ToolChoiceFunction(Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Struct):
    include_usage: bool = False


class JsonSchemaFormat(Struct, kw_only=True):
    name: str = "response"
    schema: dict | bool | None = None  # None: any JSON value
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema; accepted for compatibility


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(Struct, kw_only=True):
    model: str
    max_tokens: PositiveInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's extensions (the openai client sends them in extra_body): the k most likely tokens (-1 or 0: all),
    # and the tokens at least min_p times as likely as the most likely one
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: StopText | Annotated[list[StopText], Meta(max_length=MAX_STOP)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    logprobs: bool | int | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-sequence tokens
    response_format: ResponseFormat | None = None  # also on /v1/completions, as vLLM allows
    # token id (as a JSON key) -> bias in [-100, 100]
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None
    top_logprobs: int | None = None  # with logprobs: true, the alternatives per token (0-20)
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None  # a forced call is one; an "auto" answer may list several
    # The deprecated function calling: declared only so that a request using it gets a 400 instead of
    # a plain-text answer that silently ignored its functions.
    functions: list | None = None
    function_call: str | dict | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Text | Annotated[list[Text | int], Meta(max_length=MAX_TEXT_CHARS)]
    max_tokens: NonNegInt | None = None  # 0: nothing generated (with echo and logprobs: the prompt scored)
    echo: bool = False
    best_of: int | None = None  # generate this many, return the n with the highest log-probability per token


# --- responses --------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class UsageBody(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    refusal: None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class FunctionDelta(Struct):
    name: str | UnsetType = UNSET
    arguments: str = ""


class ToolCallDelta(Struct, kw_only=True):
    index: int
    function: FunctionDelta
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class TextLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


class ChatDelta(Struct):
    role: str | UnsetType = UNSET
    content: str | None | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: UsageBody | None | UnsetType = UNSET  # present (null until the last chunk) only with include_usage


class TextChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: TextLogprobs | None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageBody | None | UnsetType = UNSET
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str
    object: Literal["model"] = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Struct):
    error: ErrorDetail


encode = msgspec.json.Encoder().encode


def too_deep(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a decoded JSON value nests objects and arrays more than `limit` deep; iterative, so a
    value of any depth is measured without recursion."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
