"""The platform's UsageSink: usage events written to the ledger in batches, off the request path, spooled when it can't.

- `emit` only appends to an in-memory queue. A background task writes the queue with ledger_db.write_events: a full
  batch (`batch_size`) at once, anything less every `flush_interval_s`.
- A flush writes what was queued when it began (and full batches that filled meanwhile), never the trickle that
  arrives while it writes: a write costs the event loop about the same for 3 rows as for 200, so chasing each write
  with the next would keep the writer busy in small batches, on the requests' event loop, under a steady load.
- Database down (an outage, or a write slower than `write_timeout_s`, as behind a network that drops packets): the
  batch goes to the durable spool (spool.py), and so does what the queue holds beyond `max_queue`; while it is down,
  batches go straight to the spool and a write is retried every `retry_s`; once one succeeds the spool is replayed.
  Written twice is harmless (the request_id is unique), lost is not.
- Database refuses a batch for its content (a value out of range, a string too long; db_errors.py tells this from an
  outage): the batch is split until the refused events are alone; the others land, those are quarantined
  (spool.QUARANTINE, counted in `events_quarantined`, logged once) and never block the queue or a replay.
- Spool unwritable (disk full, I/O error): the events stay queued in memory and the spool is retried every `retry_s`
  (counted in `spool_failures`); the database is still tried first. Memory holds at most `max_queue + max_held`
  events; beyond that new events are dropped, counted in `events_dropped` and logged (at most every 10 s): the one
  way usage is lost besides a kill while events are queued.
- All spool file work (append, fsync, rename, read, delete) runs on one thread of its own, in the order asked, never
  on the event loop.
- A normal shutdown writes or spools the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from loraplex.billing.db_errors import is_refusal
from loraplex.billing.ledger_db import write_events
from loraplex.billing.spool import Spool
from loraplex.billing.usage import UsageEvent

log = logging.getLogger("loraplex.ledger")
_FORGET_QUARANTINED = 100_000  # request ids remembered so that a replay does not quarantine them twice


def _reason(exc: BaseException) -> str:
    """The first line of the database's message, for logs and the quarantine file."""
    return (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""])[0][:300]


class CommitListener(Protocol):
    """Told the ledger id of every event once its batch is committed (tail.Tail)."""

    commit_lock: asyncio.Lock

    def committed(self, ids: Mapping[str, int]) -> None: ...

    def uncertain(self, request_ids: list[str]) -> None: ...


class LedgerWriter:
    """Usage events to the ledger in batches, to the spool while it is down (module docstring)."""

    def __init__(self, db: AsyncEngine, spool: Spool, listener: CommitListener, *, batch_size: int = 200,
                 flush_interval_s: float = 0.2, max_queue: int = 10_000, retry_s: float = 1.0,
                 max_held: int | None = None, write_timeout_s: float = 10.0):
        self._db = db
        self.spool = spool
        self._listener = listener
        self._batch_size = batch_size
        self._interval = flush_interval_s
        self._max_queue = max_queue
        self._max_total = max_queue + (max_queue if max_held is None else max_held)
        self._retry_s = retry_s
        self._write_timeout = write_timeout_s
        self._queue: deque[UsageEvent] = deque()
        self._wake: asyncio.Event | None = None
        self._busy: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None
        self._spill_task: asyncio.Task | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-spool")
        self._stopping = False
        self._closed = False
        self._failed_at: float | None = None  # the last failed write, while the database is down
        self._spool_failed_at: float | None = None  # the last failed spool write, while it fails
        self._dropped_logged_at = 0.0
        self._quarantined_ids: set[str] = set()
        self.rows_written = 0
        self.write_failures = 0
        self.events_spooled = 0
        self.spool_failures = 0
        self.events_quarantined = 0
        self.events_dropped = 0

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def down(self) -> bool:
        """The last write failed: events are going to the spool."""
        return self._failed_at is not None

    @property
    def spool_down(self) -> bool:
        """The last spool write failed: events the database cannot take are held in memory."""
        return self._spool_failed_at is not None

    def emit(self, event: UsageEvent) -> None:
        if len(self._queue) >= self._max_total:
            self._drop(1)
            return
        self._queue.append(event)
        if len(self._queue) > self._max_queue:  # the database cannot keep up: keep the rest on disk
            self._spill_soon()
        elif len(self._queue) >= self._batch_size and self._wake is not None:
            self._wake.set()

    def _drop(self, count: int) -> None:
        self.events_dropped += count
        if time.monotonic() - self._dropped_logged_at > 10:
            self._dropped_logged_at = time.monotonic()
            log.error("usage events lost: neither the ledger nor the spool (%s) takes them and %d are held in "
                      "memory; %d dropped so far", self.spool.dir, len(self._queue), self.events_dropped)

    def start(self) -> list[UsageEvent]:
        """Starts the background writer; returns the events claimed from stopped processes' spools
        (read here, once, before the app serves)."""
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

    def _spool_due(self) -> bool:
        return self._spool_failed_at is None or time.monotonic() - self._spool_failed_at >= self._retry_s

    async def _on_io(self, fn, *args):
        """Runs spool file work on the spool's own thread, in the order asked."""
        return await asyncio.get_running_loop().run_in_executor(self._io, functools.partial(fn, *args))

    async def flush(self) -> None:
        """Writes (or spools) everything queued when it is called, then replays the spool if the
        database answers. Events queued while it writes wait for the next flush unless they make
        up a whole batch. What neither the database nor the spool takes stays queued."""
        async with self._busy:
            due = len(self._queue)
            while self._queue and (due > 0 or len(self._queue) >= self._batch_size):
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self._batch_size))]
                due -= len(batch)
                try:
                    rest = await self._land(batch) if self._retry_due() else batch
                except BaseException:  # cancelled mid-write: it may or may not be in; keep it all
                    self._listener.uncertain([e.request_id for e in batch])
                    self._queue.extendleft(reversed(batch))
                    raise
                if rest and not (self._spool_due() and await self._to_spool(rest)):
                    self._queue.extendleft(reversed(rest))  # held: tried again at the next flush
                    break
            if not self.spool.empty and self._retry_due():
                await self._replay()

    async def _land(self, batch: list[UsageEvent]) -> list[UsageEvent]:
        """Writes the batch, quarantining the events the database refuses; returns what is not in
        (the database is down, or the quarantine could not be written)."""
        rest, refused = await self._isolate(batch)
        if refused and not await self._quarantine(refused):
            rest += [e for e, _ in refused]
        return rest

    async def _isolate(self, batch: list[UsageEvent]) -> tuple[list[UsageEvent], list[tuple[UsageEvent, str]]]:
        """(not written: the database is down, refused alone with the reason). A refused batch is
        halved until every event it refuses is alone; the others land."""
        batch = [e for e in batch if e.request_id not in self._quarantined_ids]
        if not batch:
            return [], []
        error = await self._write(batch)
        if error is None:
            return [], []
        if not is_refusal(error):
            return batch, []
        if len(batch) == 1:
            return [], [(batch[0], f"{type(error).__name__}: {_reason(error)}")]
        half = len(batch) // 2
        rest, refused = await self._isolate(batch[:half])
        if rest:  # down meanwhile: the second half is not tried
            return rest + batch[half:], refused
        rest, more = await self._isolate(batch[half:])
        return rest, refused + more

    async def _write(self, batch: list[UsageEvent]) -> BaseException | None:
        """One transaction; None once it is committed, else the error (logged once while down)."""
        async with self._listener.commit_lock:
            try:
                async with asyncio.timeout(self._write_timeout):  # a database that drops packets
                    ids = await write_events(self._db, batch)
            except Exception as exc:
                if is_refusal(exc):  # rolled back, and the database answers
                    self._reachable()
                    return exc
                self._listener.uncertain([e.request_id for e in batch])  # a lost commit reply: it may be in
                self.write_failures += 1
                if self._failed_at is None:
                    log.error("usage ledger unreachable (%s: %s); spooling usage events to %s", type(exc).__name__,
                              _reason(exc)[:200], self.spool.dir)
                self._failed_at = time.monotonic()
                return exc
            self._listener.committed(ids)
        self._reachable()
        self.rows_written += len(batch)
        return None

    def _reachable(self) -> None:
        if self._failed_at is not None:
            log.warning("usage ledger reachable again")
        self._failed_at = None

    async def _quarantine(self, refused: list[tuple[UsageEvent, str]]) -> bool:
        try:
            await self._on_io(self.spool.quarantine, refused)
        except Exception as exc:
            log.error("cannot write the usage quarantine in %s (%s); %d refused events kept", self.spool.dir,
                      exc, len(refused))
            return False
        if len(self._quarantined_ids) > _FORGET_QUARANTINED:
            self._quarantined_ids.clear()
        self._quarantined_ids.update(e.request_id for e, _ in refused)
        self.events_quarantined += len(refused)
        first, reason = refused[0]
        log.error("the usage ledger refused %d event(s), quarantined in %s (first: %s, %s)", len(refused),
                  self.spool.dir, first.request_id, reason)
        return True

    async def _to_spool(self, batch: list[UsageEvent]) -> bool:
        """True once the batch is durable in the spool; False (counted, logged once) if it cannot be."""
        try:
            await self._on_io(self.spool.append, batch)
        except Exception as exc:
            self.spool_failures += 1
            if self._spool_failed_at is None:
                log.error("cannot write the usage spool in %s (%s: %s); holding usage events in memory and "
                          "retrying", self.spool.dir, type(exc).__name__, exc)
            self._spool_failed_at = time.monotonic()
            return False
        if self._spool_failed_at is not None:
            log.warning("usage spool writable again")
            self._spool_failed_at = None
        self.events_spooled += len(batch)
        return True

    def _spill_soon(self) -> None:
        if self._wake is not None and self._spool_due() and (self._spill_task is None or self._spill_task.done()):
            self._spill_task = asyncio.get_running_loop().create_task(self._spill(), name="ledger-spill")

    async def _spill(self) -> None:
        """Moves what the queue holds beyond `max_queue` (the newest) to the spool, without waiting
        for a write in progress."""
        while len(self._queue) > self._max_queue and self._spool_due():
            surplus = [self._queue.pop() for _ in range(len(self._queue) - self._max_queue)][::-1]
            if not await self._to_spool(surplus):
                self._queue.extend(surplus)
                return

    async def _replay(self) -> None:
        """Writes the spool's files, oldest first; a file is deleted once all of it is in the
        ledger or quarantined. Stops at the first outage (the rest waits for the next try)."""
        try:
            files = await self._on_io(self.spool.set_aside)
        except OSError as exc:
            log.error("cannot set the usage spool aside for replay: %s", exc)
            return
        for locked in files:
            try:
                events = await self._on_io(self.spool.read, locked)
            except OSError as exc:
                log.error("cannot read the usage spool %s: %s", locked.path.name, exc)
                continue
            for i in range(0, len(events), self._batch_size):
                if await self._land(events[i:i + self._batch_size]):
                    return
            await self._on_io(self.spool.done, locked, len(events))
            log.info("replayed %d spooled usage events", len(events))

    async def close(self) -> None:
        """Stops the background task and writes, or spools, what is left; what neither takes is
        counted as dropped and logged."""
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            await self._task
            self._task = None
            if self._spill_task is not None:
                await self._spill_task
            while self._queue:  # requests that ended during the last flush
                before = self.rows_written + self.events_spooled + self.events_quarantined
                await self.flush()
                if self._queue and before == self.rows_written + self.events_spooled + self.events_quarantined:
                    await self._last_resort()
        if not self._closed:
            self._closed = True
            await self._on_io(self.spool.close)
            self._io.shutdown(wait=True)

    async def _last_resort(self) -> None:
        """At shutdown, what neither the ledger nor the spool took: one more try of the spool, then
        it is lost (counted and logged)."""
        self._spool_failed_at = None
        batch = list(self._queue)
        self._queue.clear()
        if not await self._to_spool(batch):
            self._dropped_logged_at = 0.0
            self._drop(len(batch))
