"""A short-lived cache of database reads that requests in use never wait for.

- Staleness bound: an entry is served while it is younger than `ttl_s`, counted from when its read began, and never
  after (a key revoked on another instance is refused within it).
- Refresh ahead: once an entry is `refresh_at` of its TTL old, the next hit starts one read in the background and is
  answered from the entry meanwhile, so an entry that requests keep using is replaced before it expires and none of
  them waits for the database. An entry nobody used for a while is read in line.
- Concurrent reads of one entry share one query. `invalidate()` forgets every entry and every read in flight, so a
  change made through this instance is seen by the next request.
- Outage: while the database is down, entries keep serving for `grace_s` (outage.py); once a read has found it down,
  an entry past its TTL is answered at once while one read in the background checks whether it is back.
- Memory stays bounded whatever the keys are: at most `max_entries`, the least recently stored dropped first; an
  entry past its TTL and the outage grace is dropped as newer ones are stored; and a value `keep` refuses (a miss: a
  key or model that does not exist) is answered but never stored, so strings a client invents take no room.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from loraplex.platform.outage import load_or_stale

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RefreshingCache(Generic[K, V]):
    def __init__(self, load: Callable[[K], Awaitable[V]], ttl_s: float, *, what: str, grace_s: float = 900.0,
                 refresh_at: float = 0.75, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic,
                 keep: Callable[[V], bool] | None = None):
        self._load = load
        self._ttl = ttl_s
        self._refresh_after = ttl_s * refresh_at
        self._what = what
        self._grace = grace_s
        self._max = max_entries
        self._clock = clock
        self._keep = keep
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()  # least recently stored first
        self._reads: dict[K, asyncio.Task] = {}
        self._generation = 0  # bumped by invalidate(): reads begun before it are not stored
        self._down = False  # the last read found the database down and fell back to an entry

    async def get(self, key: K) -> V:
        entry = self._entries.get(key)
        if entry is not None:
            age = self._clock() - entry[0]
            if age < self._ttl:
                if age >= self._refresh_after and key not in self._reads:
                    self._read(key, entry)
                return entry[1]
            if self._down and age < self._grace:
                if key not in self._reads:
                    self._read(key, entry)
                return entry[1]
        read = self._reads.get(key) or self._read(key, entry)
        return await asyncio.shield(read)  # a caller that gives up does not cancel the others' read

    def invalidate(self) -> None:
        self._generation += 1
        self._entries.clear()
        self._reads.clear()

    def _read(self, key: K, entry: tuple[float, V] | None) -> asyncio.Task:
        task = asyncio.create_task(self._fetch(key, entry), name=f"read {self._what}")
        self._reads[key] = task
        task.add_done_callback(lambda t: self._done(key, t))
        return task

    def _done(self, key: K, task: asyncio.Task) -> None:
        if self._reads.get(key) is task:
            del self._reads[key]
        if not task.cancelled():
            task.exception()  # retrieved: a background read that failed leaves the entry to expire

    async def _fetch(self, key: K, entry: tuple[float, V] | None) -> V:
        generation = self._generation
        result = await load_or_stale(lambda: self._load(key), entry, self._clock(), self._grace, self._what)
        self._down = result is entry  # (load_or_stale answers with the entry itself when it fell back)
        loaded_at, value = result
        if generation == self._generation:
            if self._keep is not None and not self._keep(value):
                self._entries.pop(key, None)
            else:
                self._store(key, (loaded_at, value))
        return value

    def _store(self, key: K, entry: tuple[float, V]) -> None:
        """Stores as the most recent entry, then drops the oldest while there are too many or they
        are too old to serve even during an outage."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        useless_before = self._clock() - max(self._ttl, self._grace)
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if len(self._entries) <= self._max and oldest[0] >= useless_before:
                break
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
