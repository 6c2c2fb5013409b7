"""Turns a run's events into OpenAI bodies: one JSON response, or SSE chunks ending in [DONE].

Chat and text completions differ only in how a piece of text is wrapped, so the two `Format`
classes hold those differences and the streaming and collecting loops are shared. A request with
`n` choices has one `Format` per choice (each holds its choice's state: its index, the echo still
to put first, the text offset, a tool call's text so far); the body is the first one's.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence

import msgspec
from msgspec import UNSET

from loraplex.engine.api import GenerateEvent, TokenLogprob
from loraplex.platform.errors import PlatformError
from loraplex.platform.openai import schemas as s
from loraplex.platform.openai.generation import GenerationRun

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


def token_text(token: bytes) -> str:
    """A token as text; one holding part of a UTF-8 character shows U+FFFD (`bytes` is exact)."""
    return token.decode("utf-8", errors="replace")


Logprobs = Sequence[TokenLogprob]


class ChatFormat:
    def __init__(self, rid: str, created: int, model: str, include_usage: bool = False, logprobs: bool = False,
                 index: int = 0):
        self.id, self.created, self.model, self.index = f"chatcmpl-{rid}", created, model, index
        self._usage = None if include_usage else UNSET
        self._logprobs = logprobs

    def _lp(self, entries: Logprobs) -> s.ChatLogprobs | None:
        if not self._logprobs:
            return None
        return s.ChatLogprobs([s.ChatTokenLogprob(token_text(e.token), e.logprob, list(e.token), [
            s.TopLogprob(token_text(b), lp, list(b)) for _, b, lp in e.top]) for e in entries])

    def _chunk(self, delta: s.ChatDelta, finish: str | None = None, logprobs: s.ChatLogprobs | None = None) -> bytes:
        return sse(s.ChatCompletionChunk(self.id, self.created, self.model,
                                         [s.ChatChunkChoice(self.index, delta, finish, logprobs)], usage=self._usage))

    def first(self) -> bytes | None:
        return self._chunk(s.ChatDelta(role="assistant", content=""))

    def echoed(self, event: GenerateEvent) -> tuple[str, Logprobs]:
        return "", ()

    def delta(self, text: str, logprobs: Logprobs = ()) -> bytes | None:
        return self._chunk(s.ChatDelta(content=text), logprobs=self._lp(logprobs))

    def last(self, finish_reason: str) -> bytes:
        return self._chunk(s.ChatDelta(), finish_reason)

    def usage(self, usage: s.UsageBody) -> bytes:
        return sse(s.ChatCompletionChunk(self.id, self.created, self.model, [], usage=usage))

    def choice(self, text: str, logprobs: Logprobs, finish_reason: str) -> s.ChatChoice:
        return s.ChatChoice(self.index, s.AssistantMessage(text), finish_reason, self._lp(logprobs))

    def body(self, choices: list[s.ChatChoice], usage: s.UsageBody) -> s.ChatCompletion:
        return s.ChatCompletion(self.id, self.created, self.model, choices, usage)


class TextFormat:
    def __init__(self, rid: str, created: int, model: str, include_usage: bool = False, logprobs: bool = False,
                 index: int = 0, echo: str | bool | None = None):
        self.id, self.created, self.model, self.index = f"cmpl-{rid}", created, model, index
        self._usage = None if include_usage else UNSET
        self._logprobs = logprobs
        self._offset = 0  # characters of token text so far: text_offset continues across chunks
        self._echo = echo  # the prompt text to put first, True to take it from the prompt's tokens, None

    def echoed(self, event: GenerateEvent) -> tuple[str, Logprobs]:
        """What an echo puts before the first event's text: the prompt, and its tokens' log-probabilities
        when the completion asked for logprobs."""
        if self._echo is None:
            return "", ()
        echo, self._echo = self._echo, None
        entries = event.prompt_logprobs
        text = echo if isinstance(echo, str) else token_text(b"".join(e.token for e in entries))
        return text, entries if self._logprobs else ()

    def _lp(self, entries: Logprobs) -> s.TextLogprobs | None:
        """OpenAI's legacy shape: each token's top alternatives as a dict, the chosen token included."""
        if not self._logprobs:
            return None
        tokens = [token_text(e.token) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        tops = [None if e.logprob is None else {**{token_text(b): lp for _, b, lp in e.top}, t: e.logprob}
                for t, e in zip(tokens, entries, strict=True)]
        return s.TextLogprobs(tokens, [e.logprob for e in entries], tops, offsets)

    def first(self) -> bytes | None:
        return None

    def delta(self, text: str, logprobs: Logprobs = ()) -> bytes | None:
        choice = s.TextChoice(self.index, text, None, self._lp(logprobs))
        return sse(s.Completion(self.id, self.created, self.model, [choice], usage=self._usage))

    def last(self, finish_reason: str) -> bytes:
        return sse(s.Completion(self.id, self.created, self.model, [s.TextChoice(self.index, "", finish_reason)],
                                usage=self._usage))

    def usage(self, usage: s.UsageBody) -> bytes:
        return sse(s.Completion(self.id, self.created, self.model, [], usage=usage))

    def choice(self, text: str, logprobs: Logprobs, finish_reason: str) -> s.TextChoice:
        return s.TextChoice(self.index, text, finish_reason, self._lp(logprobs))

    def body(self, choices: list[s.TextChoice], usage: s.UsageBody) -> s.Completion:
        return s.Completion(self.id, self.created, self.model, choices, usage=usage)


Format = ChatFormat | TextFormat


async def collect(run: GenerationRun, formats: Sequence[Format], keep: int | None = None):
    """The whole body. With fewer choices to `keep` than were generated (best_of), the ones whose
    generated tokens have the highest mean log-probability, best first."""
    parts: list[list[str]] = [[] for _ in formats]
    logprobs: list[list[TokenLogprob]] = [[] for _ in formats]
    scores: list[list[float]] = [[] for _ in formats]  # generated tokens' log-probabilities
    try:
        async for i, event in run.events():
            echo, echo_logprobs = formats[i].echoed(event)
            parts[i].append(echo + event.text)
            logprobs[i].extend(echo_logprobs)
            logprobs[i].extend(event.logprobs)
            scores[i].extend(e.logprob for e in event.logprobs)
    finally:
        await run.close()
    if run.status != "ok":
        raise _failure(run)
    choices = [f.choice("".join(p), lp, reason)
               for f, p, lp, reason in zip(formats, parts, logprobs, run.finish_reasons, strict=True)]
    if keep is not None and keep < len(choices):
        mean = [sum(v) / len(v) if v else -math.inf for v in scores]
        best = sorted(range(len(choices)), key=lambda i: -mean[i])[:keep]
        choices = [msgspec.structs.replace(choices[i], index=rank) for rank, i in enumerate(best)]
    return formats[0].body(choices, usage_body(run))


async def stream(run: GenerationRun, formats: Sequence[Format], include_usage: bool) -> AsyncIterator[bytes]:
    """SSE chunks, each choice's under its index as they come. Leaving early (client gone) runs
    `finally`, whose close() aborts the request."""
    try:
        for fmt in formats:
            first = fmt.first()
            if first is not None:
                yield first
        async for i, event in run.events():
            fmt = formats[i]
            echo, echo_logprobs = fmt.echoed(event)
            text, logprobs = echo + event.text, (*echo_logprobs, *event.logprobs)
            chunk = fmt.delta(text, logprobs) if text or logprobs else None
            if chunk is not None:
                yield chunk
            if run.ended_well(event):
                yield fmt.last(event.finish_reason)
        if run.status != "ok":
            err = _failure(run)
            yield sse({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}})
        elif include_usage:
            yield formats[0].usage(usage_body(run))
        yield DONE
    finally:
        await run.close()
