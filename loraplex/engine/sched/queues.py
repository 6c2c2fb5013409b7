"""Waiting queues per priority class, with weighted admission and aging.

Classes share admissions by weight (stride scheduling: each admission advances its class's pass by
1 / weight, and the class whose next admission would finish first, pass + 1 / weight, goes next),
so with weights 10:5:1 and all queues full, realtime gets 10 of every 16 admissions and batch still
gets 1; a burst of realtime requests arriving behind a queue of batch ones goes ahead of it. A class that was idle
rejoins at the current pass rather than with credit banked while idle. Aging: a request waiting
longer than `aging_s` goes ahead of every class, oldest first, so nothing starves.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from loraplex.engine.api import PRIORITY_CLASSES
from loraplex.engine.sched.request import Request

RANK = {name: i for i, name in enumerate(PRIORITY_CLASSES)}  # realtime 0, standard 1, batch 2


class PriorityQueues:
    def __init__(self, weights: tuple[float, ...] = (10.0, 5.0, 1.0), aging_s: float = 30.0):
        if len(weights) != len(PRIORITY_CLASSES) or any(w <= 0 for w in weights):
            raise ValueError(f"priority weights must be {len(PRIORITY_CLASSES)} positive numbers, got {weights}")
        self.weights = dict(zip(PRIORITY_CLASSES, weights, strict=True))
        self.aging_s = aging_s
        self.queues: dict[str, deque[Request]] = {c: deque() for c in PRIORITY_CLASSES}
        self._pass = dict.fromkeys(PRIORITY_CLASSES, 0.0)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def __bool__(self) -> bool:
        return any(self.queues.values())

    def __iter__(self) -> Iterator[Request]:
        for q in self.queues.values():
            yield from q

    def depth(self) -> dict[str, int]:
        return {c: len(q) for c, q in self.queues.items()}

    def add(self, req: Request, front: bool = False) -> None:
        """Queues a request; `front` puts it at the head of its class (a preempted request)."""
        q = self.queues[req.priority]
        if not q:  # rejoining: no credit for the time it was idle
            busy = [self._pass[c] for c, other in self.queues.items() if other]
            self._pass[req.priority] = max(self._pass[req.priority], min(busy, default=0.0))
        if front:
            q.appendleft(req)
        else:
            q.append(req)

    def remove(self, req: Request) -> None:
        self.queues[req.priority].remove(req)

    def admitted(self, req: Request) -> None:
        """Charges the request's class for one admission."""
        self._pass[req.priority] += 1.0 / self.weights[req.priority]

    def in_admission_order(self, now: float | None = None) -> Iterator[Request]:
        """Waiting requests in the order admission should consider them, lazily and without removing
        any: an aged queue head first (oldest first), else the class whose next admission finishes first.
        Queues are FIFO, so a class's aged requests are a prefix of it."""
        now = time.monotonic() if now is None else now
        passes = dict(self._pass)
        pos = dict.fromkeys(PRIORITY_CLASSES, 0)
        while True:
            heads = {c: q[pos[c]] for c, q in self.queues.items() if pos[c] < len(q)}
            if not heads:
                return
            aged = [c for c, r in heads.items() if now - r.arrival >= self.aging_s]
            if aged:
                c = min(aged, key=lambda k: heads[k].arrival)
            else:
                c = min(heads, key=lambda k: (passes[k] + 1.0 / self.weights[k], RANK[k]))
                passes[c] += 1.0 / self.weights[c]
            yield heads[c]
            pos[c] += 1
