"""The tenant API: /v1/chat/completions, /v1/completions, /v1/models (OpenAI's shapes).

Each handler parses its body, hands the work to OpenAIService (service.py: resolve, admit, run,
settle) and formats what it returns as JSON or SSE (formatting.py). Anything refused before the
engine starts costs the caller nothing but, for 429s, the request itself.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from litestar import Request, Response, Router, get, post
from litestar.background_tasks import BackgroundTask
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, JSONBody
from litestar.response import Stream

from loraplex.billing.usage import utcnow
from loraplex.platform.auth import CALLER_KEY, Caller, caller_of
from loraplex.platform.middleware import request_hex
from loraplex.platform.openai import conversion as conv
from loraplex.platform.openai import formatting as fmt
from loraplex.platform.openai import schemas as s
from loraplex.platform.openai import tool_calls
from loraplex.platform.openai.service import Job, OpenAIService
from loraplex.platform.openai.usage import usage
from loraplex.platform.state import Platform, PlatformDep

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def authenticate(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A guard, so the key is checked before the body is parsed: no 400 details for strangers."""
    platform: Platform = connection.app.state.platform
    arrived, arrived_at = time.perf_counter(), utcnow()
    principal = await platform.auth.authenticate(connection.headers.get("authorization"))
    connection.scope[CALLER_KEY] = Caller(principal, arrived, arrived_at)  # type: ignore[literal-required]


async def _generate(request: Request, platform: Platform, job: Job, fmt_cls: Callable[..., fmt.Format]) -> Response:
    """Starts the job and answers with its choices, as JSON or as server-sent events."""
    rid = request_hex(request.scope)
    started = await OpenAIService(platform).start(caller_of(request), rid, request.headers.get("x-priority"), job)
    data = job.data
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    created = int(time.time())
    formats = [fmt_cls(rid, created, started.model, include_usage, conv.logprobs(data) is not None, index=i)
               for i in range(started.choices)]
    if data.stream:
        body = fmt.stream(started.run, formats, include_usage)
        # Litestar stops iterating when the client disconnects; the background task then closes
        # the generator, whose `finally` aborts the engine request.
        return Stream(body, media_type="text/event-stream", headers={**started.headers, **SSE_HEADERS},
                      background=BackgroundTask(body.aclose))
    return Response(await fmt.collect(started.run, formats, keep=data.n), headers=started.headers)


@post("/chat/completions", status_code=200, summary="Create a chat completion")
async def chat_completions(request: Request, platform: PlatformDep,
                           data: JSONBody[s.ChatCompletionRequest]) -> Response:
    call = tool_calls.plan(data)
    messages = conv.chat_messages(data)
    if call is not None:
        messages = tool_calls.with_prompt(messages, call)
    job = Job(data, {"messages": messages}, conv.chat_max_tokens(data), "/v1/chat/completions", call)
    return await _generate(request, platform, job, fmt.ChatFormat if call is None else call.format_class())


@post("/completions", status_code=200, summary="Create a text completion")
async def completions(request: Request, platform: PlatformDep, data: JSONBody[s.CompletionRequest]) -> Response:
    job = Job(data, conv.completion_prompt(data), conv.completion_max_tokens(data), "/v1/completions")
    return await _generate(request, platform, job, functools.partial(fmt.TextFormat, echo=conv.echo_text(data)))


@get("/models", summary="List the base models and the caller's adapters")
async def models(request: Request, platform: PlatformDep) -> s.ModelList:
    return s.ModelList(await OpenAIService(platform).models(caller_of(request).principal))


@get("/models/{model_id:path}", summary="Retrieve one model")
async def model(request: Request, platform: PlatformDep, model_id: FromPath[str]) -> s.ModelCard:
    return await OpenAIService(platform).model(caller_of(request).principal, model_id.lstrip("/"))


openai_router = Router(path="/v1", route_handlers=[chat_completions, completions, models, model, usage],
                       tags=["openai"], guards=[authenticate])
