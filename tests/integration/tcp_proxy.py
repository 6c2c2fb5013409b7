"""A TCP proxy on its own thread, to take a database "down" and bring it back: `down()` stops
listening and cuts every open connection (clients see refused and reset connections, as when the
server goes away), `blackhole()` keeps accepting connections but forwards nothing either way (as
when a network drops packets: clients wait on their timeouts), `up()` forwards again on the same
port (connections that lost bytes in a blackhole are cut, as a real network's would time out)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._blackhole = False
        self._swallowed: set[asyncio.StreamWriter] = set()  # connections that lost bytes in a blackhole

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def start(self) -> TcpProxy:
        self._thread.start()
        self.up()
        return self

    def up(self) -> None:
        self._call(self._up())

    def down(self) -> None:
        self._call(self._cut())

    def blackhole(self) -> None:
        """Accepts and reads, forwards nothing: every open and new connection goes silent."""
        self._call(self._silence())

    def stop(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _up(self) -> None:
        self._blackhole = False
        for writer in list(self._swallowed):
            writer.transport.abort()
            self._writers.discard(writer)
        self._swallowed.clear()
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _silence(self) -> None:
        self._blackhole = True
        self._swallowed.update(self._writers)
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _cut(self) -> None:
        self._blackhole = False
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in [*self._writers, *self._swallowed]:
            writer.transport.abort()
        self._writers.clear()
        self._swallowed.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if self._blackhole or writer in self._swallowed:
                    continue  # dropped on the floor
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._blackhole:  # accepted, never answered
            self._swallowed.add(writer)
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while await reader.read(65536):
                    pass
            self._swallowed.discard(writer)
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))
        self._swallowed.difference_update((writer, up_writer))


def through(url: str, proxy: TcpProxy) -> str:
    """The database URL with its host and port replaced by the proxy's."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
