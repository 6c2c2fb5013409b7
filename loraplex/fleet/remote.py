"""One worker, reached through its HTTP API (worker_app): calls that raise what the engine raised.

RemoteWorker is a plain client; the fleet keeps the workers' health and decides what goes where.
A worker that cannot be reached, or that drops a stream before its last event, raises
WorkerUnavailableError.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from loraplex.engine.api import EngineError, GenerateEvent, GenerateRequest, Usage
from loraplex.fleet import wire

HEALTH_TIMEOUT_S = 5.0  # a worker that takes longer to say how it is counts as not answering


class WorkerUnavailableError(EngineError):
    code = "worker_unavailable"


class RemoteWorker:
    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 30.0,
                 stream_idle_s: float = wire.STREAM_IDLE_S):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a worker's address is an http:// or https:// URL, got {url!r}")
        self.url = url.rstrip("/")
        self.stream_idle_s = stream_idle_s  # a stream silent this long (no event, no heartbeat) is lost
        headers = {"authorization": f"Bearer {token}"} if token else {}
        timeout = httpx.Timeout(timeout_s)
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)
        # for the calls made from threads or before the event loop runs (registering an adapter, the first probe)
        self._sync = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __repr__(self) -> str:
        return f"RemoteWorker({self.url!r})"

    def _unavailable(self, exc: Exception) -> WorkerUnavailableError:
        return WorkerUnavailableError(f"worker {self.url} unavailable: {type(exc).__name__}: {exc}")

    def _read(self, response: httpx.Response, kind: type[wire.T] | None) -> wire.T | None:
        if not response.is_success:
            raise wire.error_from(response.status_code, response.content)
        return None if kind is None else self._decode(response.content, kind)

    def _decode(self, data: bytes | str, kind: type[wire.T]) -> wire.T:
        try:
            return wire.decode(data, kind)
        except wire.WireError as exc:  # not a worker of this version, or not a worker
            raise WorkerUnavailableError(f"worker {self.url} answered something else: {exc}") from None

    async def _call(self, method: str, path: str, kind: type[wire.T] | None, body: object = None,
                    params: dict | None = None, timeout: float | None = None) -> wire.T | None:
        try:
            response = await self._client.request(method, path, content=None if body is None else wire.encode(body),
                                                  params=params, timeout=timeout or self._client.timeout)
        except httpx.HTTPError as exc:
            raise self._unavailable(exc) from None
        return self._read(response, kind)

    def _call_now(self, method: str, path: str, kind: type[wire.T] | None, body: object = None) -> wire.T | None:
        """The same call, blocking (from a thread, or before the event loop runs)."""
        try:
            response = self._sync.request(method, path, content=None if body is None else wire.encode(body))
        except httpx.HTTPError as exc:
            raise self._unavailable(exc) from None
        return self._read(response, kind)

    async def health(self) -> wire.Health:
        return await self._call("GET", "/engine/health", wire.Health, timeout=HEALTH_TIMEOUT_S)

    def health_now(self) -> wire.Health:
        return self._call_now("GET", "/engine/health", wire.Health)

    async def prepare(self, request: GenerateRequest) -> GenerateRequest:
        return await self._call("POST", "/engine/prepare", GenerateRequest, request)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """The request's events. A refusal raises its EngineError before the first; a stream that
        ends without a last event, or stays silent for `stream_idle_s` (the worker sends a heartbeat
        line more often), raises WorkerUnavailableError. Closing this early closes the connection,
        and the worker aborts the request."""
        timeout = httpx.Timeout(self._client.timeout.connect, read=self.stream_idle_s)
        try:
            async with self._client.stream("POST", "/engine/generate", content=wire.encode(request),
                                           timeout=timeout) as response:
                if not response.is_success:
                    raise wire.error_from(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if line:
                        event = self._decode(line, GenerateEvent)
                        yield event
                        if event.finished:
                            return
        except httpx.HTTPError as exc:
            raise self._unavailable(exc) from None
        raise WorkerUnavailableError(f"worker {self.url} ended request {request.request_id!r}'s stream early")

    async def abort(self, request_id: str) -> Usage | None:
        return (await self._call("POST", "/engine/abort", wire.Aborted, params={"request_id": request_id})).usage

    def add_adapter(self, adapter_id: str, path: str, base_model: str | None) -> None:
        """Blocking: the worker reads and checks the files before it answers."""
        self._call_now("POST", "/engine/adapters", None, wire.AdapterIn(adapter_id, path, base_model))

    async def remove_adapter(self, adapter_id: str, base_model: str | None) -> None:
        params = {"adapter_id": adapter_id} | ({} if base_model is None else {"base_model": base_model})
        await self._call("DELETE", "/engine/adapters", None, params=params)

    async def aclose(self) -> None:
        await self._client.aclose()
        self._sync.close()
