"""A tenant request's flow, behind the thin handlers: resolve the model, admit, run; the run settles.

- resolve: a named base model or adapter (routing/resolution.py), or `auto` (routing/auto.py); the
  engine validates and tokenizes the request once, off the event loop, and every choice generates
  from that prepared request. A 400 here costs no rate limit.
- admit: priority class, then the budget and RPM/TPM reservation (admission.py): the prompt plus
  max_tokens for each choice; a request without max_tokens reserves what fits in the context,
  capped by its tenant's default (or LORAPLEX_DEFAULT_MAX_TOKENS), and the engine stops there.
- run: the choices are submitted to the engine (generation.py); if it refuses one, the
  reservation is released and nothing is billed.
- settle: `GenerationRun.close()`, which the formatting's stream or collect calls however the
  response ends, emits the usage event and settles the reservation with the tokens used.
- models: what /v1/models lists, and one model as /v1/models/{id} shows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.engine.api import GenerateRequest, InvalidRequestError, ModelNotFoundError
from loraplex.platform.admission import Ticket, effective_priority
from loraplex.platform.auth import Caller, Principal
from loraplex.platform.db.tables import as_utc
from loraplex.platform.errors import model_not_found
from loraplex.platform.openai import conversion as conv
from loraplex.platform.openai import schemas as s
from loraplex.platform.openai import tool_calls
from loraplex.platform.openai.generation import GenerationRun
from loraplex.platform.routing import auto as auto_route
from loraplex.platform.routing.resolution import Target
from loraplex.platform.state import Platform
from loraplex.platform.tenancy.catalog import AUTO, list_adapters, list_models

Body = s.ChatCompletionRequest | s.CompletionRequest


@dataclass(frozen=True)
class Job:
    """What a handler parsed from a generation request."""

    data: Body
    prompt: dict  # the engine request's prompt fields: {"messages": ...} or {"prompt": ...}
    max_tokens: int | None  # None: what fits in the context, capped by the tenant's default
    endpoint: str  # as the usage event and the latency metric name it
    call: tool_calls.ToolPlan | None = None  # a chat request's tool plan


@dataclass(frozen=True)
class Started:
    """An admitted request whose choices the engine is generating: what the formatting needs."""

    run: GenerationRun  # its events; closing it settles the request
    headers: dict[str, str]  # rate-limit headers, and the model `auto` chose
    model: str  # the model the response names: the one `auto` chose, else the one asked for
    choices: int  # the choices generated (best_of of them, when more than n)


class OpenAIService:
    """The tenant API's work over one app's Platform, for a caller the auth guard identified."""

    def __init__(self, platform: Platform):
        self.platform = platform

    async def start(self, caller: Caller, request_hex: str, priority_header: str | None, job: Job) -> Started:
        """Resolves, admits and starts one generation; raises an OpenAI-shaped error before
        anything is sent to the client if any step refuses."""
        platform, principal, data = self.platform, caller.principal, job.data
        conv.check_supported(data)
        priority = effective_priority(principal.max_priority, priority_header)
        sampling = conv.sampling(data, job.max_tokens)
        if job.call is not None and job.call.schema is not None:  # a forced call: its schema holds the output
            sampling = dataclasses.replace(sampling, json_schema=job.call.schema)

        def request_for(model: str, adapter: str | None = None) -> GenerateRequest:
            return GenerateRequest(request_id=f"req_{request_hex}", model=model, adapter=adapter, sampling=sampling,
                                   priority=priority, cache_salt=principal.cache_salt, **job.prompt)

        routed = await self._route(principal, job, request_for)
        gen, max_tokens, room = self._fit(principal, routed, job.max_tokens)
        choices = conv.generated_choices(data)
        ticket = await platform.admission.admit(principal, gen.request_id, caller.arrived_at, routed.prompt_tokens,
                                                (room if max_tokens is None else max_tokens) * choices)
        run = await self._run(caller, routed, gen, ticket, job.endpoint, choices)
        if sampling.json_schema is not None:
            platform.metrics.structured.labels(_structured_kind(data, job.call)).inc()
        target = routed.target
        return Started(run, {**ticket.headers, **self._note_route(target)},
                       target.base_model if target.routed_from else data.model, choices)

    async def _route(self, principal: Principal, job: Job,
                     request_for: Callable[..., GenerateRequest]) -> auto_route.Routed:
        """The target and its prepared engine request; a tool plan's schema error names the tools."""
        platform = self.platform
        try:
            if job.data.model == AUTO:
                cap = self._cap(principal) if job.max_tokens is None else job.max_tokens
                return await auto_route.route(platform.router, platform.scorer, platform.engine, principal,
                                              auto_route.request_text(job.prompt, job.max_tokens), request_for, cap)
            return await self._resolve(principal, job.data.model, request_for)
        except InvalidRequestError as e:
            if job.call is not None and e.param == "response_format":  # the schema was the tools' parameters
                raise InvalidRequestError(e.message.replace("invalid JSON schema", "invalid tool parameters"),
                                          "tools") from None
            raise

    async def _resolve(self, principal: Principal, model: str,
                       request_for: Callable[[str, str | None], GenerateRequest]) -> auto_route.Routed:
        """A named base model or adapter: its target, its engine request (prepared: validated and
        tokenized once, off the event loop) and the prompt's length."""
        platform = self.platform
        target = await platform.router.resolve(principal, model)
        if target.adapter is not None:
            await platform.adapters.ensure(target.adapter, target.requested)
        gen = request_for(target.base_model, target.adapter.engine_id if target.adapter else None)
        try:
            gen = await platform.engine.prepare(gen)  # validates everything; a 400 costs no rate limit
        except ModelNotFoundError:
            raise model_not_found(model) from None
        return auto_route.Routed(target, gen, len(gen.prompt_token_ids))

    def _cap(self, principal: Principal) -> int:
        """The most a request without max_tokens may generate (0: what fits in the context)."""
        return principal.default_max_tokens or self.platform.settings.default_max_tokens

    def _fit(self, principal: Principal, routed: auto_route.Routed,
             max_tokens: int | None) -> tuple[GenerateRequest, int | None, int]:
        """The engine request with the max_tokens it may generate, that max_tokens (None: none set
        and no cap), and the room its prompt leaves in the model's context."""
        gen, prompt_tokens = routed.request, routed.prompt_tokens
        context = next((m.max_model_len for m in self.platform.engine.models()
                        if m.name == routed.target.base_model), prompt_tokens)
        room = max(0, context - prompt_tokens)
        cap = self._cap(principal)
        if max_tokens is None and cap and room:  # the engine must stop where the reservation ends
            max_tokens = min(room, cap)
            gen = dataclasses.replace(gen, sampling=dataclasses.replace(gen.sampling, max_tokens=max_tokens))
        return gen, max_tokens, room

    async def _run(self, caller: Caller, routed: auto_route.Routed, gen: GenerateRequest, ticket: Ticket,
                   endpoint: str, choices: int) -> GenerationRun:
        """Submits the choices; a refusal releases the reservation before the error leaves."""
        run = GenerationRun(self.platform.runs, gen, caller.principal, routed.target, ticket, routed.prompt_tokens,
                            endpoint, caller.arrived, caller.arrived_at, n=choices)
        try:
            run.start()
        except BaseException:
            await run.discard()
            raise
        return run

    def _note_route(self, target: Target) -> dict[str, str]:
        """For a request `auto` routed, once admitted: counts the choice in the metrics and returns the
        headers that tell it."""
        if target.complexity is None:
            return {}
        metrics = self.platform.metrics
        metrics.auto_routed.labels(target.base_model).inc()
        metrics.auto_complexity.observe(target.complexity)
        return {"x-loraplex-model": target.base_model, "x-loraplex-complexity": f"{target.complexity:.4f}"}

    # /v1/models

    def _served(self) -> set[str]:
        """The base models this instance's engine serves: a catalog row alone (another instance's
        model, or one registered but never served) is not listed, and answers 404 when asked for."""
        return {m.name for m in self.platform.engine.models()}

    async def models(self, principal: Principal) -> list[s.ModelCard]:
        """The served base models the key may use, `auto` if it may use it, and its tenant's adapters on them."""
        platform = self.platform
        async with platform.sessions() as session:
            models = await list_models(session)
            adapters = await list_adapters(session, principal.tenant_id)
        usable = self._served()
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

    async def model(self, principal: Principal, name: str) -> s.ModelCard:
        """One model's card; 404 exactly as a generation asking for it would get."""
        platform = self.platform
        if name == AUTO:
            if not await auto_route.available(platform.router, platform.engine, principal):
                raise model_not_found(name)
            return s.ModelCard(AUTO, 0, "loraplex")
        target = await platform.router.resolve(principal, name)
        if target.base_model not in self._served():
            raise model_not_found(name)
        card = next((c for c in await self.models(principal) if c.id == name), None)
        return card or s.ModelCard(name, 0, principal.tenant)


def _structured_kind(data: Body, call: tool_calls.ToolPlan | None) -> str:
    return "tool_call" if call is not None else data.response_format.type
