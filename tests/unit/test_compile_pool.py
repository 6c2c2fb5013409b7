"""The schema compilers' pool: a tenant's share, fair hand-out of free threads, cancellation, errors."""

from __future__ import annotations

import threading

import pytest

from loraplex.engine.guided.compile_pool import CompileBusy, FairCompilePool


class Gates:
    """Jobs that record when they start and wait for their own gate."""

    def __init__(self):
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.cond = threading.Condition()

    def job(self, name: str):
        self.gates[name] = threading.Event()

        def run() -> str:
            with self.cond:
                self.started.append(name)
                self.cond.notify_all()
            assert self.gates[name].wait(30)
            return name

        return run

    def wait_started(self, n: int) -> list[str]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.started) >= n, 30), self.started
            return list(self.started)


def test_a_tenant_with_nothing_compiling_goes_ahead_of_another_tenants_backlog():
    """Four threads held by tenants x and y; a queues two compiles, then b one. Freed threads go to a (nothing
    running, queued first), then to b (nothing running) before a's second (a has one running): first in, first
    out would have run a's second before b's."""
    pool, g = FairCompilePool(workers=4, per_owner=2, name="test-fair"), Gates()
    held = [pool.submit(owner, g.job(f"{owner}{i}")) for owner in "xy" for i in range(2)]
    assert sorted(g.wait_started(4)) == ["x0", "x1", "y0", "y1"]
    queued = [pool.submit("a", g.job("a0")), pool.submit("a", g.job("a1")), pool.submit("b", g.job("b0"))]
    g.gates["x0"].set()
    assert g.wait_started(5)[4] == "a0"
    g.gates["x1"].set()
    assert g.wait_started(6)[5] == "b0"
    g.gates["y0"].set()
    assert g.wait_started(7)[6] == "a1"
    for gate in g.gates.values():
        gate.set()
    assert [f.result(30) for f in held + queued] == ["x0", "x1", "y0", "y1", "a0", "a1", "b0"]
    assert all(pool.held(o) == 0 for o in "xyab")


def test_a_tenant_past_its_share_is_refused_at_once_and_shared_compiles_have_no_share():
    pool, g = FairCompilePool(workers=1, per_owner=2, name="test-share"), Gates()
    mine = [pool.submit("a", g.job("a0")), pool.submit("a", g.job("a1"))]  # one running, one queued
    with pytest.raises(CompileBusy, match="already has 2 schemas compiling"):
        pool.submit("a", g.job("a2"))
    assert pool.held("a") == 2
    shared = [pool.submit(None, g.job(f"s{i}")) for i in range(3)]  # no owner: not bounded by the share
    for gate in g.gates.values():
        gate.set()
    assert [f.result(30) for f in mine + shared] == ["a0", "a1", "s0", "s1", "s2"]
    assert pool.held("a") == 0
    assert pool.submit("a", lambda: 7).result(30) == 7  # its share is back


def test_a_compile_cancelled_while_queued_never_runs_and_gives_its_place_back():
    pool, g = FairCompilePool(workers=1, per_owner=2, name="test-cancel"), Gates()
    running = pool.submit("a", g.job("a0"))
    g.wait_started(1)
    queued = pool.submit("a", g.job("a1"))
    assert queued.cancel() and pool.held("a") == 1
    g.gates["a0"].set()
    assert running.result(30) == "a0"
    assert pool.submit("a", lambda: "after").result(30) == "after"
    assert g.started == ["a0"]  # the cancelled one never started
    assert pool.held("a") == 0


def test_a_compile_that_raises_hands_its_error_to_the_caller_and_frees_its_thread():
    pool = FairCompilePool(workers=1, per_owner=1, name="test-error")

    def boom():
        raise ValueError("bad grammar")

    with pytest.raises(ValueError, match="bad grammar"):
        pool.submit("a", boom).result(30)
    assert pool.held("a") == 0
    assert pool.submit("a", lambda: "next").result(30) == "next"
