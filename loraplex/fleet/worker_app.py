"""The worker's HTTP API: one engine (any EngineClient) for the fleet to drive, under /engine.

A worker has no tenants, keys or money: the serving instance in front of it has done all of that.
It trusts its callers, so it listens on localhost by default, and, with a token set
(LORAPLEX_WORKER_TOKEN), refuses every call without `Authorization: Bearer <token>`.

    GET    /engine/health                 Health: instance id, models, engine stats
    POST   /engine/prepare                GenerateRequest -> GenerateRequest (validated and tokenized,
                                          as EngineClient.prepare)
    POST   /engine/generate               GenerateRequest -> NDJSON, one GenerateEvent per line
                                          (and an empty line after each wire.HEARTBEAT_S without one)
    POST   /engine/abort      ?request_id= -> Aborted (its usage, or null when not in flight)
    POST   /engine/adapters   AdapterIn -> 204 (validated and registered)
    GET    /engine/adapters   ?adapter_id=&base_model= -> Present
    DELETE /engine/adapters   ?adapter_id=&base_model= -> 204 once its running requests are done

(Ids travel in query strings and bodies, never in paths, so any character in them is safe.)

An EngineError answers 400/404/500 with wire.error_body; the generate stream's errors come before
its first line, so a refused request has queued nothing. A caller that closes the stream early
aborts the request (the engine's own stream does, when it is closed).
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import anyio
from litestar import Litestar, Request, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers import BaseRouteHandler
from litestar.response import Stream

from loraplex.engine.api import EngineClient, EngineError, GenerateEvent, GenerateRequest, InvalidRequestError
from loraplex.fleet import wire

NDJSON = "application/x-ndjson"


def _json(value: object, status: int = 200) -> Response:
    return Response(wire.encode(value), status_code=status, media_type="application/json")


def _failed(exc: EngineError) -> Response:
    status, body = wire.error_body(exc)
    return Response(body, status_code=status, media_type="application/json")


async def _body(request: Request, kind: type[wire.T]) -> wire.T:
    try:
        return wire.decode(await request.body(), kind)
    except wire.WireError as exc:
        raise InvalidRequestError(str(exc)) from None


_END = object()


async def _lines(events: AsyncGenerator[GenerateEvent, None], heartbeat_s: float) -> AsyncIterator[bytes]:
    """One line per event, and an empty line after each `heartbeat_s` without one. One task reads
    the engine's stream into a queue (a timeout on the engine's own stream would abort its request);
    closing this (the caller left) cancels that task, whose cancellation aborts the request."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for event in events:
                queue.put_nowait(event)
        except Exception as exc:  # (an engine failure ends the stream: the caller sees it cut short)
            queue.put_nowait(exc)
        queue.put_nowait(_END)

    reader = asyncio.ensure_future(pump())
    try:
        while True:
            try:
                async with asyncio.timeout(heartbeat_s):
                    item = await queue.get()
            except TimeoutError:
                yield b"\n"
                continue
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield wire.encode(item) + b"\n"
            if item.finished:
                return
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


def create_worker_app(engine: EngineClient, token: str | None = None,
                      heartbeat_s: float = wire.HEARTBEAT_S) -> Litestar:
    instance = uuid.uuid4().hex

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if token is None:
            return
        given = connection.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise NotAuthorizedException("this worker needs its token (LORAPLEX_WORKER_TOKEN)")

    @get("/engine/health", sync_to_thread=False)
    def health() -> Response:
        return _json(wire.Health(instance, engine.models(), engine.stats()))

    @post("/engine/prepare")
    async def prepare(request: Request) -> Response:
        gen = await _body(request, GenerateRequest)
        return _json(await engine.prepare(gen))

    @post("/engine/generate")
    async def generate(request: Request) -> Stream:
        gen = await _body(request, GenerateRequest)
        return Stream(_lines(engine.generate(gen), heartbeat_s), media_type=NDJSON)

    @post("/engine/abort")
    async def abort(request_id: str) -> Response:
        return _json(wire.Aborted(await engine.abort(request_id)))

    @post("/engine/adapters", status_code=204)
    async def add_adapter(request: Request) -> None:
        spec = await _body(request, wire.AdapterIn)  # (reading and checking the files blocks: off the loop)
        await anyio.to_thread.run_sync(engine.add_adapter, spec.adapter_id, spec.path, spec.base_model)

    @get("/engine/adapters", sync_to_thread=False)
    def has_adapter(adapter_id: str, base_model: str | None = None) -> Response:
        return _json(wire.Present(engine.has_adapter(adapter_id, base_model)))

    @delete("/engine/adapters", status_code=204)
    async def remove_adapter(adapter_id: str, base_model: str | None = None) -> None:
        await engine.remove_adapter(adapter_id, base_model)

    return Litestar(route_handlers=[health, prepare, generate, abort, add_adapter, has_adapter, remove_adapter],
                    guards=[guard], exception_handlers={EngineError: lambda _, exc: _failed(exc)},
                    openapi_config=None)
