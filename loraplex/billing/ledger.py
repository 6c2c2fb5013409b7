"""The batched, asynchronous ledger writer: the platform's UsageSink.

`emit` only appends to a bounded in-memory queue. A background task writes the queue in batches
with ledger_db.write_events: a full batch (`batch_size`) at once, anything less every
`flush_interval_s`. A flush writes what was queued when it began (and full batches that filled
meanwhile), never the trickle that arrives while it writes: a write costs the event loop about
the same whether it holds 3 rows or 200, so chasing each write with the next one would keep the
writer busy all the time under a steady load, in small batches, on the requests' event loop.
A batch that cannot be written goes to the durable spool (spool.py), and so does anything
emitted while the queue is full; while the database is down, batches go straight to the spool
and a write is retried every `retry_s`; once one succeeds the spool is replayed. Written twice
is harmless (the request_id is unique), lost is not: only events still in the queue when the
process is killed can be lost; a normal shutdown writes or spools them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from loraplex.billing.ledger_db import write_events
from loraplex.billing.spool import Spool
from loraplex.billing.usage import UsageEvent

log = logging.getLogger("loraplex.ledger")


class CommitListener(Protocol):
    """Told the ledger id of every event once its batch is committed (tail.Tail)."""

    commit_lock: asyncio.Lock

    def committed(self, ids: Mapping[str, int]) -> None: ...

    def uncertain(self, request_ids: list[str]) -> None: ...


class LedgerWriter:
    def __init__(self, db: AsyncEngine, spool: Spool, listener: CommitListener, *, batch_size: int = 200,
                 flush_interval_s: float = 0.2, max_queue: int = 10_000, retry_s: float = 1.0):
        self._db = db
        self.spool = spool
        self._listener = listener
        self._batch_size = batch_size
        self._interval = flush_interval_s
        self._max_queue = max_queue
        self._retry_s = retry_s
        self._queue: deque[UsageEvent] = deque()
        self._wake: asyncio.Event | None = None
        self._busy: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._failed_at: float | None = None  # the last failed write, while the database is down
        self.rows_written = 0
        self.write_failures = 0
        self.events_spooled = 0

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def down(self) -> bool:
        """The last write failed: events are going to the spool."""
        return self._failed_at is not None

    def emit(self, event: UsageEvent) -> None:
        if len(self._queue) >= self._max_queue:  # the database cannot keep up: keep it on disk
            self._to_spool([event])
            return
        self._queue.append(event)
        if len(self._queue) >= self._batch_size and self._wake is not None:
            self._wake.set()

    def start(self) -> list[UsageEvent]:
        """Starts the background writer; returns the events claimed from stopped processes' spools."""
        recovered = self.spool.claim_orphans()
        self._wake, self._busy = asyncio.Event(), asyncio.Lock()
        self._task = asyncio.create_task(self._run(), name="ledger-writer")
        return recovered

    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._interval)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception("ledger flush failed")

    def _retry_due(self) -> bool:
        return self._failed_at is None or time.monotonic() - self._failed_at >= self._retry_s

    async def flush(self) -> None:
        """Writes (or spools) everything queued when it is called, then replays the spool if the
        database answers. Events queued while it writes wait for the next flush unless they make
        up a whole batch."""
        async with self._busy:
            due = len(self._queue)
            while self._queue and (due > 0 or len(self._queue) >= self._batch_size):
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self._batch_size))]
                due -= len(batch)
                try:
                    written = self._retry_due() and await self._write(batch)
                except BaseException:  # cancelled mid-write: it may or may not be in; the spool makes sure
                    self._listener.uncertain([e.request_id for e in batch])
                    self._to_spool(batch)
                    raise
                if not written:
                    self._to_spool(batch)
            if not self.spool.empty and self._retry_due():
                await self._replay()

    async def _write(self, batch: list[UsageEvent]) -> bool:
        async with self._listener.commit_lock:
            try:
                ids = await write_events(self._db, batch)
            except (SQLAlchemyError, OSError) as exc:
                self._listener.uncertain([e.request_id for e in batch])  # a lost commit reply: it may be in
                self.write_failures += 1
                if self._failed_at is None:
                    reason = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""])[0][:200]
                    log.error("usage ledger unreachable (%s: %s); spooling usage events to %s", type(exc).__name__,
                              reason, self.spool.dir)
                self._failed_at = time.monotonic()
                return False
            self._listener.committed(ids)
        if self._failed_at is not None:
            log.warning("usage ledger reachable again")
        self._failed_at = None
        self.rows_written += len(batch)
        return True

    def _to_spool(self, batch: list[UsageEvent]) -> None:
        self.spool.append(batch)
        self.events_spooled += len(batch)

    async def _replay(self) -> None:
        for locked, events in self.spool.pending():
            for i in range(0, len(events), self._batch_size):
                if not await self._write(events[i:i + self._batch_size]):
                    return
            self.spool.done(locked, len(events))
            log.info("replayed %d spooled usage events", len(events))

    async def close(self) -> None:
        """Stops the background task and writes, or spools, what is left."""
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            await self._task
            self._task = None
            while self._queue:  # requests that ended during the last flush
                await self.flush()
        self.spool.close()
