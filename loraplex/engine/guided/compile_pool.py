"""The schema compilers: a few threads shared by every tenant, handed out fairly, so that no tenant's flood of
slow schemas makes another tenant's schema wait behind it.

- Each owner (a tenant: the request's cache salt) has at most `per_owner` compiles queued or running; one more
  is refused at once (CompileBusy), before it takes a place in the queue.
- A free thread takes the oldest queued compile of the owner with the fewest compiles running; so a tenant with
  nothing compiling goes ahead of every tenant already compiling, and waits behind at most one queued compile
  of each other idle tenant, whatever their backlog (a first-in, first-out queue would put it behind all of it).
- Compiles are futures: one cancelled before it starts never runs, and its place is given back at once.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

SHARED = ""  # the owner of compiles that name none (not counted against a per-owner share)


class CompileBusy(RuntimeError):
    """No compile now: the owner has its share queued or running, or the compile did not start within its wait
    (other schemas held the compilers). The schema is not at fault: retry."""


class FairCompilePool:
    """`workers` daemon threads (started on first use) running submitted calls, owners served fairly."""

    def __init__(self, workers: int, per_owner: int, name: str):
        self.workers, self.per_owner, self._name = workers, per_owner, name
        self._queued: dict[str, deque[tuple[int, Future, Callable[[], object]]]] = {}
        self._running: dict[str, int] = {}
        self._held: dict[str, int] = {}  # per owner: queued + running (what per_owner bounds)
        self._order = itertools.count()  # submission order, for ties between owners
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []

    def held(self, owner: str) -> int:
        """The owner's compiles queued or running."""
        with self._cond:
            return self._held.get(owner, 0)

    def submit(self, owner: str | None, fn: Callable, *args, **kwargs) -> Future:
        """Queues fn(*args, **kwargs) for `owner` (None: SHARED, no share); CompileBusy past its share."""
        owner = SHARED if owner is None else owner
        future: Future = Future()
        with self._cond:
            n = self._held.get(owner, 0)
            if owner != SHARED and n >= self.per_owner:
                raise CompileBusy(f"this tenant already has {n} schemas compiling; try again when they are done")
            self._held[owner] = n + 1
            self._queued.setdefault(owner, deque()).append((next(self._order), future, lambda: fn(*args, **kwargs)))
            while len(self._threads) < self.workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify()
        future.add_done_callback(lambda f: self._cancelled(owner, f) if f.cancelled() else None)
        return future

    def _cancelled(self, owner: str, future: Future) -> None:
        """A future cancelled while queued: out of the queue, its place given back."""
        with self._cond:
            queue = self._queued.get(owner)
            for job in queue or ():
                if job[1] is future:
                    queue.remove(job)
                    if not queue:
                        del self._queued[owner]
                    self._release(owner)
                    return

    def _release(self, owner: str) -> None:
        """One of the owner's compiles left (lock held)."""
        self._held[owner] -= 1
        if not self._held[owner]:
            del self._held[owner]

    def _next(self) -> tuple[str, Future, Callable[[], object]]:
        """Blocks for the next job: the owner with the fewest running, then the oldest job (lock held)."""
        while not self._queued:
            self._cond.wait()
        owner = min(self._queued, key=lambda o: (self._running.get(o, 0), self._queued[o][0][0]))
        queue = self._queued[owner]
        _, future, call = queue.popleft()
        if not queue:
            del self._queued[owner]
        self._running[owner] = self._running.get(owner, 0) + 1
        return owner, future, call

    def _work(self) -> None:
        while True:
            with self._cond:
                owner, future, call = self._next()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = call()
                    except BaseException as e:  # the caller's future carries it
                        future.set_exception(e)
                    else:
                        future.set_result(result)
            finally:
                with self._cond:
                    self._running[owner] -= 1
                    if not self._running[owner]:
                        del self._running[owner]
                    self._release(owner)
