"""AffinityRouter: Serve's request router for the engine replicas, keeping each adapter (and each tenant's base-model
prompts) on few replicas within a load bound.

Why not Serve's multiplexed routing alone: it learns which replica holds an id from the replicas' reports, seconds
later, so the first requests of a new adapter land on every replica and each loads it into a slot. Rendezvous
ranking needs no report: every gateway ranks the replicas for a key the same way, at once.

Policy, per request with a multiplexed id (its affinity key):
- a replica is overloaded when its ongoing requests (Serve's queue-length cache) pass SLACK x the mean + FLOOR;
- first the replicas that hold the key now (their multiplexed ids), then the others, each group by rendezvous
  rank (a hash of key and replica id), overloaded replicas last by their load;
- a request without a key goes to the least loaded.
Serve tries the ranks in order; a replica at its max_ongoing_requests refuses and the next is tried.
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

SLACK = 1.25  # a replica may take this much more than the mean before the key's next replica is preferred
FLOOR = 4  # ... and this many more (a lightly loaded deployment keeps its affinity)


def rendezvous_score(key: str, replica: str) -> int:
    """Highest-random-weight hashing: the same order of replicas for a key on every gateway."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(), "big")


class AffinityRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        loads = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas}
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key:
            return [[r] for r in sorted(candidate_replicas, key=lambda r: loads[r.replica_id])]
        bound = SLACK * sum(loads.values()) / max(1, len(loads)) + FLOOR
        fit = [r for r in candidate_replicas if loads[r.replica_id] <= bound]
        over = sorted((r for r in candidate_replicas if loads[r.replica_id] > bound), key=lambda r: loads[r.replica_id])

        def rank(r: RunningReplica) -> tuple[bool, int]:
            return key not in r.multiplexed_model_ids, -rendezvous_score(key, r.replica_id.unique_id)

        return [[r] for r in sorted(fit, key=rank) + over]
