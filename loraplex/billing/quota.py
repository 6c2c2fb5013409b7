"""Budgets and rate limits for one process: admission, settlement, and counters kept equal to the ledger.

- Admission is one store operation (one Lua script in Redis): the key's RPM/TPM buckets and the six budget counters,
  checked and reserved together. Settlement replaces the reservation by the tokens used.
- Both name the epoch they expect. When the counters were lost (flush, restart, expiry, a dead process), the first
  process to notice rebuilds them from the ledger under a lock, with a high-water mark, and every process then
  *adopts* the new epoch: it adds its charges that the ledger did not hold at the mark (reservations in flight, usage
  not yet written). Nothing is counted twice and nothing is missed (tail.py, rebuild.py).
- When in doubt (Redis failed mid-call, so whether a script ran is unknown), the tenant is marked dirty and its
  counters are rebuilt.
- The platform emits a request's usage event when it ends and settles it just after, so its ledger row may be
  committed before its settlement ran: a rebuild that counts the row drops the charge, and the settlement then has
  nothing left to change in the counters (what its TPM bucket lent comes back as the bucket refills, as for a
  settlement that could not reach Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.exc import SQLAlchemyError

from loraplex.billing.budgets import BudgetRule, counter_names, limits_for
from loraplex.billing.counters import CounterStore, CountersUnavailable, Outcome, marker_hwm
from loraplex.billing.ratelimit import Decision, Limits
from loraplex.billing.tail import Charge, Tail
from loraplex.billing.usage import UsageEvent, utcnow

log = logging.getLogger("loraplex.billing")
_ATTEMPTS = 4
UsageReader = Callable[[int, datetime], Awaitable[tuple[int, dict[str, int]]]]
IdLookup = Callable[[list[str]], Awaitable[dict[str, int]]]


async def _nothing_written(request_ids: list[str]) -> dict[str, int]:
    return {}


@dataclass(frozen=True)
class AdmitRequest:
    request_id: str
    tenant_id: int
    key_id: int
    at: datetime  # arrival: decides the periods charged
    reserve: int  # prompt + the most the request may generate
    budgets: tuple[BudgetRule, ...] = ()
    rate: Limits = Limits()
    rate_tokens: int = 0  # what the TPM bucket is asked for (capped there at the limit)


@dataclass(frozen=True)
class Verdict:
    charge: Charge | None  # None: refused
    decision: Decision | None = None  # RPM/TPM windows for the headers
    refused: str | None = None  # "requests", "tokens" or "quota"
    rule: BudgetRule | None = None  # quota: the budget that refused
    held: int = 0  # quota: what its counter holds


class _Gate:
    """Per tenant: store operations run shared, adoption runs alone, so no charge changes state
    between a script's reply and the bookkeeping that follows it. Entering and leaving shared
    while no adoption waits costs no lock (every request does it twice)."""

    def __init__(self) -> None:
        self._readers = 0
        self._open = asyncio.Event()  # no adoption holds the gate or waits for it
        self._open.set()
        self._drained = asyncio.Event()  # no shared holder
        self._drained.set()

    async def _wait_open(self) -> None:
        while not self._open.is_set():  # another waiter may close it again first
            await self._open.wait()

    @contextlib.asynccontextmanager
    async def shared(self):
        await self._wait_open()
        self._readers += 1
        self._drained.clear()
        try:
            yield
        finally:
            self._readers -= 1
            if not self._readers:
                self._drained.set()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        await self._wait_open()
        self._open.clear()
        try:
            await self._drained.wait()
            yield
        finally:
            self._open.set()


class Quota:
    def __init__(self, store: CounterStore, tail: Tail, usage: UsageReader, lookup: IdLookup = _nothing_written, *,
                 instance: str | None = None, clock: Callable[[], datetime] = utcnow, rebuild_wait_s: float = 10.0):
        """`usage`: the ledger's sums for a rebuild (rebuild.tenant_usage); `lookup`: the ledger ids
        of request ids (rebuild.ledger_ids), for charges whose write may or may not have happened."""
        self.store = store
        self.tail = tail
        self._usage = usage
        self._lookup = lookup
        self.instance = instance or secrets.token_hex(6)
        self._clock = clock
        self._rebuild_wait_s = rebuild_wait_s
        self._known: dict[int, str] = {}  # tenant -> the marker this process has adopted
        self._dirty: set[int] = set()  # tenants whose counters must be rebuilt before use
        self._gates: dict[int, _Gate] = {}
        self.rebuilds = 0

    def _gate(self, tenant_id: int) -> _Gate:
        return self._gates.setdefault(tenant_id, _Gate())

    # --- the request path -------------------------------------------------------------------

    async def admit(self, req: AdmitRequest) -> Verdict:
        counters = counter_names(req.key_id, req.at)
        limits = limits_for(counters, req.budgets, req.key_id, req.at)
        charge = Charge(req.request_id, req.tenant_id, req.key_id, counters, req.reserve, tpm=req.rate.tpm or 0)

        async def op(marker: str) -> Outcome:
            out = await self.store.admit(req.tenant_id, marker, charge, limits, req.rate, req.rate_tokens)
            if out.status == "ok":
                charge.epoch, charge.tpm_reserved = marker, out.decision.reserved_tokens
                self.tail.add(charge)
            return out

        out = await self._in_epoch(req.tenant_id, op)
        if out.status == "ok":
            return Verdict(charge, out.decision)
        if out.status == "quota":
            name, limit = counters[out.refused], limits[out.refused]
            rule = next(r for r in req.budgets if r.counter(req.key_id, req.at) == name and r.limit_tokens == limit)
            return Verdict(None, refused="quota", rule=rule, held=out.held)
        return Verdict(None, out.decision, out.decision.refused)

    def admit_unchecked(self, req: AdmitRequest) -> Charge:
        """Fail-open admission while the counters cannot be reached: nothing is checked, and the
        charge joins the counters when they are back (the tenant is rebuilt, then adopts it)."""
        charge = Charge(req.request_id, req.tenant_id, req.key_id, counter_names(req.key_id, req.at), req.reserve)
        self.tail.add(charge)
        self._dirty.add(req.tenant_id)
        return charge

    async def settle(self, charge: Charge, used: int) -> dict[str, int]:
        """Replaces the reservation by `used`; returns each counter's tokens used after (empty
        when the counters could not be reached: the charge is then counted once they are)."""
        if charge.epoch is None:
            self._finish(charge, used)
            return {}

        async def op(_marker: str) -> Outcome:
            if charge.epoch is None:  # a rebuild meanwhile counted its ledger row, and not its reservation
                self._finish(charge, used)
                return Outcome("ok")
            out = await self.store.settle(charge.tenant_id, charge.epoch, charge, used)
            if out.status == "ok":
                self._finish(charge, used)
            return out

        try:
            out = await self._in_epoch(charge.tenant_id, op)
        except CountersUnavailable as exc:
            log.warning("settling %s later: %s", charge.request_id, exc)
            charge.epoch = None
            self._finish(charge, used)
            return {}
        return dict(zip(charge.counters, out.used, strict=True)) if out.used else {}

    def _finish(self, charge: Charge, used: int) -> None:
        charge.used = used
        if used == 0:  # nothing to count, and no ledger row will come
            self.tail.discard(charge)

    async def _in_epoch(self, tenant_id: int, op: Callable[[str], Awaitable[Outcome]]) -> Outcome:
        """Runs `op` with the adopted marker; rebuilds or adopts and tries again when told to."""
        for _ in range(_ATTEMPTS):
            if tenant_id in self._dirty:
                await self._sync(tenant_id)
            async with self._gate(tenant_id).shared():
                try:
                    out = await op(self._known.get(tenant_id, ""))
                except CountersUnavailable:
                    self._dirty.add(tenant_id)
                    raise
            if out.status not in ("stale", "missing"):
                return out
            await self._sync(tenant_id)
        raise CountersUnavailable("the budget counters kept changing under this request; try again")

    # --- epochs -----------------------------------------------------------------------------

    async def _sync(self, tenant_id: int) -> None:
        async with self._gate(tenant_id).exclusive():
            for _ in range(_ATTEMPTS):
                if tenant_id in self._dirty:
                    await self.store.invalidate(tenant_id)
                    self._dirty.discard(tenant_id)
                marker = await self.store.marker(tenant_id) or await self._rebuild(tenant_id)
                if await self._adopt(tenant_id, marker):
                    return
        raise CountersUnavailable("the budget counters could not be brought up to date")

    async def _rebuild(self, tenant_id: int) -> str:
        token = secrets.token_hex(8)
        deadline = time.monotonic() + self._rebuild_wait_s
        while True:
            out = await self.store.begin_rebuild(tenant_id, token)
            if out.status == "exists":
                return out.marker
            if out.status == "ok":
                break
            if time.monotonic() > deadline:
                raise CountersUnavailable("another process is taking too long to rebuild the budget counters")
            await asyncio.sleep(0.02)
        try:
            hwm, used = await self._usage(tenant_id, self._clock())
        except (SQLAlchemyError, OSError) as exc:
            await self.store.finish_rebuild(tenant_id, token, "", {})  # releases the lock
            raise CountersUnavailable(f"the ledger cannot be read to rebuild the budget counters: "
                                      f"{type(exc).__name__}") from None
        marker = f"{out.marker}|{secrets.token_hex(6)}|{hwm}"
        if not await self.store.finish_rebuild(tenant_id, token, marker, used):
            raise CountersUnavailable("the budget counters changed while they were being rebuilt")
        self.rebuilds += 1
        log.info("rebuilt the budget counters of tenant %d from the ledger (up to row %d)", tenant_id, hwm)
        return marker

    async def _adopt(self, tenant_id: int, marker: str) -> bool:
        """Adds this process's charges that the epoch's rebuild could not see; drops those it counted."""
        hwm = marker_hwm(marker)
        async with self.tail.commit_lock:
            await self._resolve_uncertain([c for c in self.tail.of(tenant_id) if c.epoch != marker])
            deltas: dict[str, list[int]] = {}
            moved, counted = [], []
            for charge in self.tail.of(tenant_id):
                if charge.epoch == marker:
                    continue
                if charge.ledger_id is not None and charge.ledger_id <= hwm:
                    counted.append(charge)
                    continue
                moved.append(charge)
                for name in charge.counters:
                    deltas.setdefault(name, [0, 0])[0 if charge.used is None else 1] += charge.amount
            if deltas:
                out = await self.store.adopt(tenant_id, marker, {k: (r, u) for k, (r, u) in deltas.items()})
                if out.status != "ok":
                    return False
            for charge in moved:
                charge.epoch = marker
            for charge in counted:  # the rebuild read its row: a settlement still to come has nothing to do
                charge.epoch = None
                self.tail.discard(charge)
        self._known[tenant_id] = marker
        return True

    async def _resolve_uncertain(self, charges: list[Charge]) -> None:
        """Asks the ledger about charges whose row may have been written (a failed write, a spool)."""
        unknown = [c for c in charges if c.maybe_written and c.ledger_id is None]
        if not unknown:
            return
        try:
            found = await self._lookup([c.request_id for c in unknown])
        except (SQLAlchemyError, OSError) as exc:
            raise CountersUnavailable(f"the ledger cannot be asked which usage it holds: {type(exc).__name__}") \
                from None
        self.tail.committed(found)

    # --- in the background ------------------------------------------------------------------

    def recover(self, events: Iterable[UsageEvent]) -> None:
        """Usage found in the spool of a stopped process: counted again once the ledger has it
        or the tenant's counters are rebuilt (they may or may not hold it now, so rebuild)."""
        for e in events:
            charge = Charge(e.request_id, e.tenant_id, e.key_id, counter_names(e.key_id, e.created_at),
                            e.total_tokens, used=e.total_tokens, maybe_written=True)
            self.tail.add(charge)
            self._dirty.add(e.tenant_id)

    async def reconcile(self) -> None:
        """One round: heartbeat, then every tenant with charges or marked dirty is brought to
        the current epoch, and charges the ledger holds in that epoch are dropped."""
        dead = await self.store.heartbeat(self.instance)
        if dead:
            log.warning("%d process(es) stopped without settling; budget counters will be rebuilt", dead)
        for tenant_id in {*self._dirty, *self.tail.tenants()}:
            try:
                await self._check(tenant_id)
            except CountersUnavailable as exc:
                log.debug("tenant %d not reconciled: %s", tenant_id, exc)

    async def _check(self, tenant_id: int) -> None:
        seq = self.tail.seq  # commits up to here happened before the marker is read
        marker = None if tenant_id in self._dirty else await self.store.marker(tenant_id)
        charges = self.tail.of(tenant_id)
        if marker is None or any(c.epoch != marker for c in charges):
            await self._sync(tenant_id)
            return
        for charge in charges:
            if charge.used is not None and charge.ledger_id is not None and charge.commit_seq <= seq:
                self.tail.discard(charge)

    async def run(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reconcile()
            except CountersUnavailable as exc:
                log.debug("reconcile skipped: %s", exc)
            except Exception:
                log.exception("reconcile failed")

    async def read(self, tenant_id: int, counters: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        """(used, reserved) of counters in the current epoch (tests, the admin API)."""
        for _ in range(_ATTEMPTS):
            marker = self._known.get(tenant_id)
            found = await self.store.read(tenant_id, marker, counters) if marker else None
            if found is not None:
                return found
            await self._sync(tenant_id)
        raise CountersUnavailable("the budget counters kept changing")

    async def close(self) -> None:
        with contextlib.suppress(CountersUnavailable):
            await self.store.heartbeat(self.instance, leaving=True)
        await self.store.close()
