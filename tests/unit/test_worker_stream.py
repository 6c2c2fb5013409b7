"""The worker's generate stream: one line per event, heartbeats while the engine is silent, and the
engine's stream closed (its request aborted) when the caller leaves."""

from __future__ import annotations

import asyncio

from loraplex.engine.api import GenerateEvent, Usage
from loraplex.fleet import wire
from loraplex.fleet.worker_app import _lines


class SlowEvents:
    """An engine stream: an event after `delay_s`, the last one after the next `delay_s`."""

    def __init__(self, delay_s: float):
        self.delay_s, self.closed = delay_s, False

    async def _gen(self):
        try:
            await asyncio.sleep(self.delay_s)
            yield GenerateEvent("r", "a", (1,))
            await asyncio.sleep(self.delay_s)
            yield GenerateEvent("r", "b", (2,), "stop", Usage(3, 2))
        finally:
            self.closed = True

    def __aiter__(self):
        return self._gen()


def test_events_come_one_a_line_with_heartbeats_between():
    async def main():
        source = SlowEvents(0.35)
        lines = [line async for line in _lines(aiter(source), heartbeat_s=0.1)]
        return source, lines
    source, lines = asyncio.run(main())
    events = [wire.decode(line, GenerateEvent) for line in lines if line != b"\n"]
    assert [e.token_ids for e in events] == [(1,), (2,)] and events[-1].finish_reason == "stop"
    first = lines.index(next(line for line in lines if line != b"\n"))
    assert first >= 2 and lines[:first] == [b"\n"] * first  # silent 0.35 s: a heartbeat each 0.1 s
    assert source.closed


def test_a_caller_leaving_closes_the_engine_stream():
    async def main():
        source = SlowEvents(10.0)
        stream = _lines(aiter(source), heartbeat_s=0.05)
        assert await anext(stream) == b"\n"
        await stream.aclose()
        return source
    assert asyncio.run(main()).closed
