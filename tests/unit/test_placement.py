"""Rendezvous placement with bounded loads: stable, spread, moves little when workers change, and
never lets a worker pass the bound while another is under it."""

from __future__ import annotations

from collections import Counter

import pytest

from loraplex.fleet.placement import pick, placement_key, ranked

WORKERS = [f"http://w{i}:8100" for i in range(4)]
KEYS = [placement_key("m", f"adapter-{i}", None) for i in range(400)]


def test_a_key_goes_to_its_first_ranked_worker_while_loads_allow_and_keeps_going_there():
    for key in KEYS[:50]:
        assert pick(key, WORKERS, {}) == ranked(key, WORKERS)[0] == pick(key, list(reversed(WORKERS)), {})


def test_keys_spread_over_the_workers():
    counts = Counter(pick(k, WORKERS, {}) for k in KEYS)
    assert set(counts) == set(WORKERS) and min(counts.values()) > 400 / 4 * 0.6


def test_a_worker_leaving_moves_only_its_own_keys_and_one_joining_takes_only_keys():
    before = {k: pick(k, WORKERS, {}) for k in KEYS}
    after = {k: pick(k, WORKERS[:3], {}) for k in KEYS}
    assert all(after[k] == before[k] for k in KEYS if before[k] != WORKERS[3])
    joined = {k: pick(k, [*WORKERS, "http://w4:8100"], {}) for k in KEYS}
    moved = [k for k in KEYS if joined[k] != before[k]]
    assert moved and all(joined[k] == "http://w4:8100" for k in moved)


def test_load_beyond_the_bound_spills_to_the_next_ranked_worker():
    key = KEYS[0]
    order = ranked(key, WORKERS)
    # 8 in flight over 4 workers: bound ceil(1.25 * 9 / 4) = 3
    assert pick(key, WORKERS, {order[0]: 2, order[1]: 2, order[2]: 2, order[3]: 2}) == order[0]
    assert pick(key, WORKERS, {order[0]: 3, order[1]: 3, order[2]: 1, order[3]: 1}) == order[2]


def test_a_worker_where_the_key_is_running_is_preferred_within_the_bound():
    key = KEYS[2]
    order = ranked(key, WORKERS)
    one_each = dict.fromkeys(WORKERS, 1)  # 4 in flight: bound ceil(1.25 * 5 / 4) = 2
    assert pick(key, WORKERS, one_each, warm={order[2]}) == order[2]  # its adapter holds a slot there
    assert pick(key, WORKERS, one_each, warm={order[1], order[2]}) == order[1]
    # beyond the bound (8 in flight: ceil(1.25 * 9 / 4) = 3), warmth does not count
    assert pick(key, WORKERS, {order[0]: 1, order[2]: 3, order[3]: 4}, warm={order[2]}) == order[0]


def test_a_worker_whose_slots_are_all_busy_is_passed_over_for_one_with_a_free_slot():
    key = KEYS[3]
    order = ranked(key, WORKERS)
    one_each = dict.fromkeys(WORKERS, 1)
    assert pick(key, WORKERS, one_each, full={order[0]}) == order[1]
    assert pick(key, WORKERS, one_each, full={order[0]}, warm={order[0]}) == order[0]  # running there already
    assert pick(key, WORKERS, one_each, full=set(WORKERS)) == order[0]  # every one busy: its own


def test_placing_many_at_once_keeps_every_worker_within_the_bound():
    load: Counter = Counter()
    for i in range(1000):
        load[pick(KEYS[i % 3], WORKERS, load)] += 1  # three hot keys
        bound = -(-1.25 * sum(load.values()) // len(WORKERS))
        assert max(load.values()) <= bound


def test_least_loaded_ignores_the_key_but_breaks_ties_by_it():
    key = KEYS[1]
    order = ranked(key, WORKERS)
    assert pick(key, WORKERS, {}, policy="least_loaded") == order[0]
    assert pick(key, WORKERS, {order[0]: 1, order[1]: 1, order[2]: 1}, policy="least_loaded") == order[3]


def test_base_model_requests_are_kept_together_by_tenant():
    assert placement_key("m", None, "tenant-a") != placement_key("m", None, "tenant-b")
    assert placement_key("m", None, None) != placement_key("m", "", None)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="no workers"):
        pick("k", [], {})
    with pytest.raises(ValueError, match="slack"):
        pick("k", WORKERS, {}, slack=0.5)
    with pytest.raises(ValueError, match="unknown placement policy"):
        pick("k", WORKERS, {}, policy="random")
