"""Which worker serves a request: rendezvous hashing with bounded loads.

Each (base model, adapter, cache salt) key ranks the workers by a hash of (key, worker), the same
ranking in every process and across restarts. Of the workers whose load stays within `slack` times
the average, a request takes the first-ranked one where its key's requests are running now (its
adapter holds a slot there: joining them needs no load), else the first-ranked one with an adapter
slot free, else the first-ranked one. So an
adapter's requests keep landing where its weights already sit in a device slot (and its prompts'
KV in that worker's prefix cache), a worker joining or leaving moves only the keys it ranks first,
and a hot adapter spills to its second-ranked worker, and so on, instead of queueing on one.
(Consistent hashing with bounded loads, Mirrokni et al. 2018, over rendezvous ranking.)

`least_loaded` ignores the key: every request goes where the fewest are in flight, the usual
balancer's choice; it is kept for comparison (`loraplex bench fleet`) and for fleets whose workers
hold every adapter anyway.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Literal

Policy = Literal["affinity", "least_loaded"]
POLICIES: tuple[str, ...] = ("affinity", "least_loaded")
DEFAULT_SLACK = 1.25


def placement_key(model: str, adapter: str | None, cache_salt: str | None) -> str:
    """What routing keeps together: one adapter's requests; a base model's by tenant (cache salt),
    whose requests tend to share a system prompt."""
    return f"{model}\0{adapter}" if adapter is not None else f"{model}\0\0{cache_salt or ''}"


def _score(key: str, worker: str) -> int:
    digest = hashlib.blake2b(f"{key}\0{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranked(key: str, workers: Sequence[str]) -> list[str]:
    """The workers in the key's order of preference (highest rendezvous score first)."""
    return sorted(workers, key=lambda w: _score(key, w), reverse=True)


def pick(key: str, workers: Sequence[str], load: Mapping[str, int], *, policy: Policy = "affinity",
         slack: float = DEFAULT_SLACK, warm: Collection[str] = (), full: Collection[str] = ()) -> str:
    """The worker for one more request. `load`: requests in flight per worker (missing: 0).

    affinity: of the workers whose load, with this request, stays within
    ceil(slack * (total load + 1) / workers) (with slack >= 1 the least loaded worker always does),
    the first-ranked one in `warm` (where the key's requests are running now: its adapter holds a
    slot there), else the first-ranked one not in `full` (whose adapter slots all hold adapters with
    requests running: this one would wait there for a slot), else the first-ranked one.
    least_loaded: the worker with the fewest in flight (ties by the key's ranking, so equal loads
    still keep a key together)."""
    if not workers:
        raise ValueError("no workers to pick from")
    if slack < 1:
        raise ValueError(f"slack must be at least 1, got {slack}")
    order = ranked(key, workers)
    if policy == "least_loaded":
        return min(order, key=lambda w: load.get(w, 0))
    if policy != "affinity":
        raise ValueError(f"unknown placement policy {policy!r} (one of {', '.join(POLICIES)})")
    bound = math.ceil(slack * (sum(load.get(w, 0) for w in workers) + 1) / len(workers))
    room = [w for w in order if load.get(w, 0) + 1 <= bound]
    return next((w for w in room if w in warm), None) or next((w for w in room if w not in full), room[0])
