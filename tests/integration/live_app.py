"""An app from create_app served over real HTTP by uvicorn on a thread of this process, so that a
test can reach the engine behind it (to inject a fault, or to look at its tokenizer) while OpenAI's
own client talks to the server."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from tests.e2e.server import free_port


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Serves `app` on a free loopback port until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, name="live-app", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the app did not start")
            time.sleep(0.05)
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        yield base
    finally:
        server.should_exit = True
        thread.join(30)
