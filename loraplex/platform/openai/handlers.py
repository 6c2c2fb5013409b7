"""The tenant API: /v1/chat/completions, /v1/completions, /v1/models (OpenAI's shapes).

A generation goes: key -> model resolution -> priority -> engine validation and tokenization (once,
off the event loop: the prepared request is what every choice generates from) -> budget and
rate-limit reservation -> engine stream -> response (JSON or SSE). Anything refused
before the engine starts costs the caller nothing but, for 429s, the request itself. A request
without max_tokens may generate what fits in the context, capped by its tenant's default (or
LORAPLEX_DEFAULT_MAX_TOKENS), and that cap is what it reserves of its budgets.
"""

from __future__ import annotations

import dataclasses
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
from loraplex.engine.api import GenerateRequest, InvalidRequestError, ModelNotFoundError
from loraplex.platform.admission import effective_priority
from loraplex.platform.auth import CALLER_KEY, Caller, Principal, caller_of
from loraplex.platform.db.tables import as_utc
from loraplex.platform.errors import model_not_found
from loraplex.platform.middleware import request_hex
from loraplex.platform.openai import conversion as conv
from loraplex.platform.openai import formatting as fmt
from loraplex.platform.openai import schemas as s
from loraplex.platform.openai import tool_calls
from loraplex.platform.openai.generation import GenerationRun
from loraplex.platform.openai.usage import usage
from loraplex.platform.routing import auto as auto_route
from loraplex.platform.routing.resolution import Target
from loraplex.platform.state import Platform, PlatformDep
from loraplex.platform.tenancy.catalog import AUTO, list_adapters, list_models

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def authenticate(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A guard, so the key is checked before the body is parsed: no 400 details for strangers."""
    platform: Platform = connection.app.state.platform
    arrived, arrived_at = time.perf_counter(), utcnow()
    principal = await platform.auth.authenticate(connection.headers.get("authorization"))
    connection.scope[CALLER_KEY] = Caller(principal, arrived, arrived_at)  # type: ignore[literal-required]


def _principal(request: Request) -> Principal:
    return caller_of(request).principal


async def _generate(request: Request, platform: Platform, data: s.ChatCompletionRequest | s.CompletionRequest,
                    prompt: dict, max_tokens: int | None, fmt_cls: Callable[..., fmt.Format], endpoint: str,
                    call: tool_calls.ToolPlan | None = None) -> Response:
    who = caller_of(request)
    principal = who.principal
    conv.check_supported(data)
    priority = effective_priority(principal.max_priority, request.headers.get("x-priority"))
    rid = request_hex(request.scope)
    sampling = conv.sampling(data, max_tokens)
    if call is not None and call.schema is not None:  # a forced call: its schema holds the output
        sampling = dataclasses.replace(sampling, json_schema=call.schema)
    cap = principal.default_max_tokens or platform.settings.default_max_tokens

    def request_for(model: str, adapter: str | None = None) -> GenerateRequest:
        return GenerateRequest(request_id=f"req_{rid}", model=model, adapter=adapter, sampling=sampling,
                               priority=priority, cache_salt=principal.cache_salt, **prompt)

    try:
        if data.model == AUTO:
            routed = await auto_route.route(platform.router, platform.scorer, platform.engine, principal,
                                            auto_route.request_text(prompt, max_tokens), request_for,
                                            cap if max_tokens is None else max_tokens)
        else:
            routed = await _resolve(platform, principal, data.model, request_for)
    except InvalidRequestError as e:
        if call is not None and e.param == "response_format":  # the schema was the tools' parameters
            raise InvalidRequestError(e.message.replace("invalid JSON schema", "invalid tool parameters"),
                                      "tools") from None
        raise
    target, gen, prompt_tokens = routed.target, routed.request, routed.prompt_tokens
    context = next((m.max_model_len for m in platform.engine.models() if m.name == target.base_model), prompt_tokens)
    room = max(0, context - prompt_tokens)
    if max_tokens is None and cap and room:  # the engine must stop where the reservation ends
        max_tokens = min(room, cap)
        gen = dataclasses.replace(gen, sampling=dataclasses.replace(gen.sampling, max_tokens=max_tokens))
    generated = conv.generated_choices(data)
    ticket = await platform.admission.admit(principal, gen.request_id, who.arrived_at, prompt_tokens,
                                            (room if max_tokens is None else max_tokens) * generated)
    run = GenerationRun(platform.runs, gen, principal, target, ticket, prompt_tokens, endpoint, who.arrived,
                        who.arrived_at, n=generated)
    try:
        run.start()
    except BaseException:
        await run.discard()
        raise
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    headers = {**ticket.headers, **_note_route(platform, target)}
    if sampling.json_schema is not None:
        platform.metrics.structured.labels(_structured_kind(data, call)).inc()
    created, shown = int(time.time()), target.base_model if target.routed_from else data.model
    formats = [fmt_cls(rid, created, shown, include_usage, conv.logprobs(data) is not None, index=i)
               for i in range(generated)]
    if data.stream:
        body = fmt.stream(run, formats, include_usage)
        # Litestar stops iterating when the client disconnects; the background task then closes
        # the generator, whose `finally` aborts the engine request.
        return Stream(body, media_type="text/event-stream", headers={**headers, **SSE_HEADERS},
                      background=BackgroundTask(body.aclose))
    return Response(await fmt.collect(run, formats, keep=data.n), headers=headers)


async def _resolve(platform: Platform, principal: Principal, model: str,
                   request_for: Callable[[str, str | None], GenerateRequest]) -> auto_route.Routed:
    """A named base model or adapter: its target, its engine request (prepared: validated and
    tokenized once, off the event loop) and the prompt's length."""
    target = await platform.router.resolve(principal, model)
    if target.adapter is not None:
        await platform.adapters.ensure(target.adapter, target.requested)
    gen = request_for(target.base_model, target.adapter.engine_id if target.adapter else None)
    try:
        gen = await platform.engine.prepare(gen)  # validates everything; a 400 costs no rate limit
    except ModelNotFoundError:
        raise model_not_found(model) from None
    return auto_route.Routed(target, gen, len(gen.prompt_token_ids))


def _structured_kind(data: s.ChatCompletionRequest | s.CompletionRequest, call: tool_calls.ToolPlan | None) -> str:
    return "tool_call" if call is not None else data.response_format.type


def _note_route(platform: Platform, target: Target) -> dict[str, str]:
    """For a request `auto` routed, once admitted: counts the choice in the metrics and returns the
    headers that tell it."""
    if target.complexity is None:
        return {}
    platform.metrics.auto_routed.labels(target.base_model).inc()
    platform.metrics.auto_complexity.observe(target.complexity)
    return {"x-loraplex-model": target.base_model, "x-loraplex-complexity": f"{target.complexity:.4f}"}


@post("/chat/completions", status_code=200, summary="Create a chat completion")
async def chat_completions(request: Request, platform: PlatformDep,
                           data: JSONBody[s.ChatCompletionRequest]) -> Response:
    call = tool_calls.plan(data)
    messages = conv.chat_messages(data)
    if call is not None:
        messages = tool_calls.with_prompt(messages, call)
    return await _generate(request, platform, data, {"messages": messages}, conv.chat_max_tokens(data),
                           fmt.ChatFormat if call is None else call.format_class(), "/v1/chat/completions", call)


@post("/completions", status_code=200, summary="Create a text completion")
async def completions(request: Request, platform: PlatformDep, data: JSONBody[s.CompletionRequest]) -> Response:
    return await _generate(request, platform, data, conv.completion_prompt(data), conv.completion_max_tokens(data),
                           functools.partial(fmt.TextFormat, echo=conv.echo_text(data)), "/v1/completions")


def _served(platform: Platform) -> set[str]:
    """The base models this instance's engine serves: a catalog row alone (another instance's
    model, or one registered but never served) is not listed, and answers 404 when asked for."""
    return {m.name for m in platform.engine.models()}


async def _cards(platform: Platform, principal: Principal) -> list[s.ModelCard]:
    async with platform.sessions() as session:
        models = await list_models(session)
        adapters = await list_adapters(session, principal.tenant_id)
    usable = _served(platform)
    if principal.allowed_models is not None:
        usable &= set(principal.allowed_models)
    cards = [s.ModelCard(m.name, int(as_utc(m.created_at).timestamp()), "loraplex") for m in models
             if m.name in usable]
    if await auto_route.available(platform.router, platform.engine, principal):
        cards.append(s.ModelCard(AUTO, 0, "loraplex"))
    cards += [s.ModelCard(a.name, int(as_utc(a.created_at).timestamp()), principal.tenant) for a in adapters
              if a.base_model.name in usable
              and (principal.allowed_adapters is None or a.name in principal.allowed_adapters)]
    return cards


@get("/models", summary="List the base models and the caller's adapters")
async def models(request: Request, platform: PlatformDep) -> s.ModelList:
    return s.ModelList(await _cards(platform, _principal(request)))


@get("/models/{model_id:path}", summary="Retrieve one model")
async def model(request: Request, platform: PlatformDep, model_id: FromPath[str]) -> s.ModelCard:
    principal = _principal(request)
    name = model_id.lstrip("/")
    if name == AUTO:
        if not await auto_route.available(platform.router, platform.engine, principal):
            raise model_not_found(name)
        return s.ModelCard(AUTO, 0, "loraplex")
    target = await platform.router.resolve(principal, name)  # 404 exactly as for a generation
    if target.base_model not in _served(platform):
        raise model_not_found(name)
    card = next((c for c in await _cards(platform, principal) if c.id == name), None)
    return card or s.ModelCard(name, 0, principal.tenant)


openai_router = Router(path="/v1", route_handlers=[chat_completions, completions, models, model, usage],
                       tags=["openai"], guards=[authenticate])
