"""Turns a run's events into OpenAI bodies: one JSON response, or SSE chunks ending in [DONE].

Chat and text completions differ only in how a piece of text is wrapped, so the two `Format`
classes hold those differences and the streaming and collecting loops are shared.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from msgspec import UNSET

from loraplex.platform import schemas as s
from loraplex.platform.errors import PlatformError
from loraplex.platform.generation import GenerationRun

DONE = b"data: [DONE]\n\n"


def sse(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def usage_body(run: GenerationRun) -> s.UsageBody:
    return s.UsageBody(prompt_tokens=run.prompt_tokens, completion_tokens=run.completion_tokens,
                       total_tokens=run.prompt_tokens + run.completion_tokens,
                       prompt_tokens_details=s.PromptTokensDetails(cached_tokens=run.cached_tokens))


def _failure(run: GenerationRun) -> PlatformError:
    if run.status == "timeout":
        return PlatformError(504, f"The request ran longer than this server's limit of "
                                  f"{run.ctx.request_timeout_s:g}s and was stopped; it is charged for the tokens "
                                  f"generated.", code="request_timeout", type="server_error")
    return PlatformError(503, "The engine stopped this request before it finished; try again.",
                         code="generation_failed", type="server_error")


class ChatFormat:
    def __init__(self, rid: str, created: int, model: str, include_usage: bool = False):
        self.id, self.created, self.model = f"chatcmpl-{rid}", created, model
        self._usage = None if include_usage else UNSET

    def _chunk(self, delta: s.ChatDelta, finish: str | None = None) -> bytes:
        return sse(s.ChatCompletionChunk(self.id, self.created, self.model,
                                         [s.ChatChunkChoice(0, delta, finish)], usage=self._usage))

    def first(self) -> bytes | None:
        return self._chunk(s.ChatDelta(role="assistant", content=""))

    def delta(self, text: str) -> bytes:
        return self._chunk(s.ChatDelta(content=text))

    def last(self, finish_reason: str) -> bytes:
        return self._chunk(s.ChatDelta(), finish_reason)

    def usage(self, usage: s.UsageBody) -> bytes:
        return sse(s.ChatCompletionChunk(self.id, self.created, self.model, [], usage=usage))

    def body(self, text: str, finish_reason: str, usage: s.UsageBody) -> s.ChatCompletion:
        choice = s.ChatChoice(0, s.AssistantMessage(text), finish_reason)
        return s.ChatCompletion(self.id, self.created, self.model, [choice], usage)


class TextFormat:
    def __init__(self, rid: str, created: int, model: str, include_usage: bool = False):
        self.id, self.created, self.model = f"cmpl-{rid}", created, model
        self._usage = None if include_usage else UNSET

    def first(self) -> bytes | None:
        return None

    def delta(self, text: str) -> bytes:
        return sse(s.Completion(self.id, self.created, self.model, [s.TextChoice(0, text, None)], usage=self._usage))

    def last(self, finish_reason: str) -> bytes:
        return sse(s.Completion(self.id, self.created, self.model, [s.TextChoice(0, "", finish_reason)],
                                usage=self._usage))

    def usage(self, usage: s.UsageBody) -> bytes:
        return sse(s.Completion(self.id, self.created, self.model, [], usage=usage))

    def body(self, text: str, finish_reason: str, usage: s.UsageBody) -> s.Completion:
        return s.Completion(self.id, self.created, self.model, [s.TextChoice(0, text, finish_reason)], usage=usage)


Format = ChatFormat | TextFormat


async def collect(run: GenerationRun, fmt: Format):
    parts: list[str] = []
    try:
        async for event in run.events():
            parts.append(event.text)
    finally:
        await run.close()
    if run.status != "ok":
        raise _failure(run)
    return fmt.body("".join(parts), run.finish_reason, usage_body(run))


async def stream(run: GenerationRun, fmt: Format, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE chunks. Leaving early (client gone) runs `finally`, whose close() aborts the request."""
    try:
        first = fmt.first()
        if first is not None:
            yield first
        async for event in run.events():
            if event.text:
                yield fmt.delta(event.text)
            if event.finished and run.status == "ok":
                yield fmt.last(event.finish_reason)
        if run.status != "ok":
            err = _failure(run)
            yield sse({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}})
        elif include_usage:
            yield fmt.usage(usage_body(run))
        yield DONE
    finally:
        await run.close()
