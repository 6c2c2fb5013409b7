"""This process's charges that the ledger does not hold yet: the part of the counters that a
rebuild from the ledger cannot see.

A charge is one request's footprint on its tenant's counters: first a reservation, then (settled)
the tokens it used, then a ledger row. It stays here until that row is committed *and* the
counters have been seen in the same epoch after the commit; from then on any rebuild reads it
from the ledger. When the counters are rebuilt (a new epoch), `quota.Quota` adds every charge
still here to the new counters, except those whose ledger row the rebuild already counted.

The ledger writer holds `commit_lock` while it commits a batch and records the ids, so whoever
holds the lock sees every committed charge with its ledger id, except those whose write failed
in a way that leaves it unknown whether it committed (`uncertain`): those the ledger is asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class Charge:
    request_id: str
    tenant_id: int
    key_id: int
    counters: tuple[str, ...]  # "<scope>:<period id>", see budgets.counter_names
    reserved: int  # tokens held against the budgets while the request runs
    tpm: int = 0  # the key's TPM limit and what its bucket lent, for the refund at settlement
    tpm_reserved: int = 0
    used: int | None = None  # tokens charged once settled
    epoch: str | None = None  # the marker of the counters that hold this charge; None: none do
    ledger_id: int | None = None
    commit_seq: int = 0  # Tail.seq when the ledger id arrived
    maybe_written: bool = False  # a write of its row failed midway, or it came from a spool: ask the ledger

    @property
    def amount(self) -> int:
        """What this charge weighs on the counters now."""
        return self.reserved if self.used is None else self.used


class Tail:
    def __init__(self) -> None:
        self._charges: dict[str, Charge] = {}
        self._tenants: dict[int, dict[str, Charge]] = {}
        self.seq = 0
        self.commit_lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self._charges)

    def add(self, charge: Charge) -> None:
        self._charges[charge.request_id] = charge
        self._tenants.setdefault(charge.tenant_id, {})[charge.request_id] = charge

    def discard(self, charge: Charge) -> None:
        if self._charges.pop(charge.request_id, None) is charge:
            group = self._tenants[charge.tenant_id]
            group.pop(charge.request_id, None)
            if not group:
                del self._tenants[charge.tenant_id]

    def of(self, tenant_id: int) -> list[Charge]:
        return list(self._tenants.get(tenant_id, {}).values())

    def tenants(self) -> list[int]:
        return list(self._tenants)

    def committed(self, ids: Mapping[str, int]) -> None:
        """The ledger writer's report: these requests' rows are committed with these ids."""
        self.seq += 1
        for request_id, ledger_id in ids.items():
            charge = self._charges.get(request_id)
            if charge is not None:
                charge.ledger_id, charge.commit_seq = ledger_id, self.seq

    def uncertain(self, request_ids) -> None:
        """The writer's report: these rows may or may not have been committed."""
        for request_id in request_ids:
            charge = self._charges.get(request_id)
            if charge is not None:
                charge.maybe_written = True
