"""Work a request leaves behind once its response is on its way: its settlement and usage event.

The tasks are held here (asyncio keeps only weak references to tasks), their failures are
logged, and `drain()` waits for them: at shutdown, before the ledger writer and the counters
close, so nothing a request owes is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

log = logging.getLogger("loraplex.platform")


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, work: Coroutine, name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def drain(self) -> None:
        """Returns once every task spawned so far, and any they spawned, has finished."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))
