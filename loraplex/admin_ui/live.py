"""The overview's live charts: a bounded history of readings taken by a background task of the app
(every `interval_s`, off the event loop), and GET /admin/live.json that the page's script polls.

- The history holds `span_s` of points (15 minutes at 5 s: 180); memory does not grow with uptime.
- A request to the JSON endpoint only copies the points: the sampling does the reading and the maths.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from litestar import Litestar, Request, get
from litestar.response import Response

from loraplex.admin_ui.live_metrics import Reading, point, read, window
from loraplex.admin_ui.web import HEADERS
from loraplex.engine.api import PRIORITY_CLASSES

log = logging.getLogger("loraplex.admin_ui")
STATE_KEY = "admin_live"

# What the page draws: chart id -> (title, unit, [(series label, field of a point[, index or key])]).
CHARTS = {
    "requests": ("Requests per second", "/s", [("requests", "requests")]),
    "tokens": ("Tokens per second", "/s", [("prompt", "prompt_tokens"), ("output", "output_tokens")]),
    "ttft": ("Time to first token", "ms", [(f"p{round(q * 100)}", "ttft", i) for i, q in enumerate((.5, .95, .99))]),
    "itl": ("Inter-token latency", "ms", [(f"p{round(q * 100)}", "itl", i) for i, q in enumerate((.5, .95, .99))]),
    "queue": ("Queue depth by priority class", "", [(c, "queue", c) for c in PRIORITY_CLASSES]),
    "kv": ("KV cache in use", "%", [("KV use", "kv_use")]),
    "problems": ("429s and errors per second", "/s", [("429s", "rejections"), ("errors", "errors")]),
    "latency": ("Request latency", "ms", [(f"p{round(q * 100)}", "latency", i)
                                          for i, q in enumerate((.5, .95, .99))]),
}


def _value(p: dict, spec: tuple):
    value = p[spec[1]]
    if len(spec) > 2:
        value = value[spec[2]]
    return None if value is None else round(value * 100, 2) if spec[1] == "kv_use" else value


class LiveHistory:
    """The last `span_s` seconds of points, one per `interval_s`; `sample` runs on any thread."""

    def __init__(self, reader: Callable[[], Reading], interval_s: float = 5.0, span_s: float = 900.0):
        self.interval_s = interval_s
        self._reader = reader
        size = max(int(span_s / interval_s), 2)
        self._points: deque[dict] = deque(maxlen=size)
        self._readings: deque[Reading] = deque(maxlen=size + 1)
        self._lock = threading.Lock()

    def sample(self) -> None:
        reading = self._reader()
        with self._lock:
            if self._readings:
                self._points.append(point(self._readings[-1], reading))
            self._readings.append(reading)

    def as_json(self) -> dict:
        with self._lock:
            points, first, last = list(self._points), self._readings[0] if self._readings else None, \
                self._readings[-1] if self._readings else None
        charts = [{"id": cid, "title": title, "unit": unit,
                   "series": [{"name": spec[0], "values": [_value(p, spec) for p in points]} for spec in series]}
                  for cid, (title, unit, series) in CHARTS.items()]
        return {"interval_s": self.interval_s, "t": [p["t"] for p in points], "charts": charts,
                "window": window(first, last) if first and last else None}

    async def run(self) -> None:
        """Samples until cancelled; a failed reading is logged and the next one tried."""
        while True:
            try:
                await asyncio.to_thread(self.sample)
            except Exception:  # a sampler that dies would freeze the charts without a word
                log.exception("the admin UI's live charts could not read the metrics")
            await asyncio.sleep(self.interval_s)


def reader_of(platform) -> Callable[[], Reading]:
    registry, engine = platform.metrics.registry, platform.engine

    def reading() -> Reading:
        samples = [s for family in registry.collect() for s in family.samples]
        return read(samples, engine.stats(), time.monotonic(), time.time())

    return reading


def lifespan_hooks(interval_s: float):
    """(startup, shutdown) hooks that run the app's sampler."""
    tasks: list[asyncio.Task] = []

    async def start(app: Litestar) -> None:
        history = LiveHistory(reader_of(app.state.platform), interval_s)
        app.state[STATE_KEY] = history
        tasks.append(asyncio.create_task(history.run(), name="admin-ui-live-charts"))

    async def stop(app: Litestar) -> None:
        while tasks:
            task = tasks.pop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return start, stop


@get("/live.json")
async def live_json(request: Request) -> Response:
    history: LiveHistory | None = request.app.state.get(STATE_KEY)
    body = history.as_json() if history else {"interval_s": None, "t": [], "charts": [], "window": None}
    return Response(body, headers=HEADERS)
