"""One pipelined Redis connection for the budget counters' scripts: one round trip for many calls, run in order.

- Every call is queued; one writer task sends whatever is queued in one write, reads the replies in order and hands
  each to its caller, while the next calls queue up. So N requests that reach Redis together cost one round trip (one
  send, one read wake-up) instead of N, which on a busy gateway is most of what a script call costs its event loop.
- Redis runs this process's calls in the order they were made: a settlement queued before an admission is applied
  before it, whatever the event loop does in between.
- Commands are packed here (EVALSHA of a known script, or a plain command), not by redis-py's per-command machinery;
  redis-py still makes the connection (URL, AUTH, SELECT, TLS) and parses the replies.
- A call is never retried: a script whose reply was lost may have run, which only the caller can sort out (quota.py
  rebuilds the tenant's counters). A script Redis does not know (NOSCRIPT: restarted or flushed) has not run: it is
  loaded and that call queued again.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import str_if_bytes

_MAX_BATCH = 512  # calls per write, so one slow batch cannot hold everybody's reply


def _bulk(value: str | int | bytes) -> bytes:
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def pack(*args: str | int | bytes) -> bytes:
    """One command in RESP."""
    return b"*%d\r\n" % len(args) + b"".join(map(_bulk, args))


@dataclass(eq=False)
class _Call:
    data: bytes
    future: asyncio.Future
    script: str | None = None  # the script's name, to load it after a NOSCRIPT
    reloaded: bool = False


class ScriptPipe:
    def __init__(self, client: Redis, scripts: dict[str, str], timeout_s: float | None = 0.5):
        """`scripts`: name -> Lua source; `timeout_s`: the most one round trip may take."""
        self._client = client
        self._sources = scripts
        self._sha = {name: client.register_script(src).sha for name, src in scripts.items()}
        self._evalsha = {name: _bulk("EVALSHA") + _bulk(sha) for name, sha in self._sha.items()}
        self._timeout = timeout_s
        self._queue: list[_Call] = []
        self._writer: asyncio.Task | None = None
        self._conn: AbstractConnection | None = None

    def script(self, name: str, keys: list[str], args: list) -> asyncio.Future:
        """Runs a registered script: a future of its reply, or of the RedisError or OSError."""
        data = b"*%d\r\n%s%s" % (3 + len(keys) + len(args), self._evalsha[name],
                                  b"".join(map(_bulk, (len(keys), *keys, *args))))
        return self._submit(_Call(data, self._future(), name))

    def command(self, *args: str | int) -> asyncio.Future:
        return self._submit(_Call(pack(*args), self._future()))

    @staticmethod
    def _future() -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def _submit(self, call: _Call) -> asyncio.Future:
        self._queue.append(call)
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_all(), name="redis-counters-pipe")
        return call.future

    async def _write_all(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[:_MAX_BATCH], self._queue[_MAX_BATCH:]
                await self._round_trip(batch)
        finally:
            self._writer = None

    async def _round_trip(self, batch: list[_Call]) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                reload = await self._exchange(batch)
        except BaseException as exc:
            await self._drop_connection()
            if isinstance(exc, TimeoutError):  # before OSError, of which it is one
                error: BaseException = RedisTimeoutError("Redis did not answer in time")
            elif isinstance(exc, asyncio.CancelledError):
                error = RedisConnectionError("the connection to Redis was closed")
            else:
                error = exc
            for call in batch:
                _resolve(call, exc=error)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self._queue[:0] = reload  # they did not run: ahead of everything queued since

    async def _exchange(self, batch: list[_Call]) -> list[_Call]:
        """Sends the batch and hands out the replies; returns the calls to send again."""
        conn = await self._connection()
        await conn.send_packed_command(b"".join(c.data for c in batch), check_health=False)
        reload = []
        for call in batch:
            try:
                reply = await conn.read_response()
            except NoScriptError as exc:
                if call.reloaded:
                    _resolve(call, exc=exc)
                else:
                    call.reloaded = True
                    reload.append(call)
                continue
            except (RedisConnectionError, RedisTimeoutError):
                raise
            except RedisError as exc:  # an error reply: this call failed, the stream is in step
                _resolve(call, exc=exc)
                continue
            _resolve(call, reply)
        if reload:
            await self._load(conn, {c.script for c in reload})
        return reload

    async def _connection(self) -> AbstractConnection:
        if self._conn is None:
            pool = self._client.connection_pool
            # Its own connection, without redis-py's per-read timer: one deadline per round trip.
            self._conn = pool.connection_class(**{**pool.connection_kwargs, "socket_timeout": None})
        if not self._conn.is_connected:
            await self._conn.connect()
        return self._conn

    async def _load(self, conn: AbstractConnection, names: set[str]) -> None:
        ordered = sorted(names)
        await conn.send_packed_command(b"".join(pack("SCRIPT", "LOAD", self._sources[n]) for n in ordered),
                                       check_health=False)
        for name in ordered:
            if str_if_bytes(await conn.read_response()) != self._sha[name]:
                raise RedisError(f"Redis loaded the {name} script under another SHA1")

    async def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.disconnect(nowait=True)

    async def close(self) -> None:
        """Waits for the calls already queued, then closes the connection."""
        if self._writer is not None:
            await asyncio.wait([self._writer])  # its calls' failures went to their callers
        await self._drop_connection()
        self._conn = None


def _resolve(call: _Call, reply: object = None, exc: BaseException | None = None) -> None:
    if call.future.done():  # its caller was cancelled
        return
    if exc is not None:
        call.future.set_exception(exc)
    else:
        call.future.set_result(reply)
