"""The LoRA gauge an inference gateway's endpoint picker reads: which adapters run and wait, and the slots."""

from __future__ import annotations

import time

import pytest

from loraplex.engine.api import EngineStats, GenerateRequest, SamplingParams, add_stats
from loraplex.platform.metrics import LORA_INFO_MAX_ADAPTERS, lora_requests_info
from tests.conftest import _loaded, make_core
from tests.lora_factory import make_peft_dir
from tests.unit.test_engine_core import MODEL


def req(rid: str, adapter: str | None) -> GenerateRequest:
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, MODEL, prompt_token_ids=(1, 2, 3), sampling=sp, adapter=adapter)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return make_peft_dir(tmp_path_factory.mktemp("adapter") / "a", _loaded(MODEL).config, rank=4, alpha=8,
                         targets="all", seed=5)


def labels(stats: EngineStats) -> dict[str, str]:
    (sample,) = lora_requests_info(stats).samples
    return sample.labels


def step_until_one_runs(core) -> EngineStats:
    """Steps until a request runs (adapters load in the background; until then none can)."""
    for _ in range(500):
        core.step()
        stats = core.stats()
        if stats.requests.running:
            return stats
        time.sleep(0.01)
    raise AssertionError("no request ran")


def test_stats_name_the_adapters_running_and_waiting_each_once(adapter_dir):
    core = make_core(max_num_seqs=1, max_loras=2)
    for name in ("a", "b"):
        core.add_adapter(name, str(adapter_dir))
    asked = ["a", "b", "b"]
    for i, adapter in enumerate(asked):
        core.add_request(req(f"r{i}", adapter))
    assert core.stats().adapters.waiting == ("a", "b")
    stats = step_until_one_runs(core)
    (running,) = stats.adapters.running  # (which runs first is the scheduler's choice)
    asked.remove(running)
    waiting = ",".join(sorted(set(asked)))
    assert ",".join(stats.adapters.waiting) == waiting
    assert labels(stats) == {"running_lora_adapters": running, "waiting_lora_adapters": waiting, "max_lora": "2"}
    while core.has_work():
        core.step()
    stats = core.stats()
    assert (stats.adapters.running, stats.adapters.waiting) == ((), ())
    assert labels(stats) == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}


def test_the_gauge_value_is_the_sampling_time():
    before = time.time()
    (sample,) = lora_requests_info(EngineStats()).samples
    assert before <= sample.value <= time.time()


def test_many_adapters_queued_name_only_the_first_64(adapter_dir):
    """A tenant with more adapters than the bound, a request queued for each: the label stays bounded."""
    core = make_core(max_num_seqs=1)
    names = [f"adapter-{i:03d}-1" for i in range(LORA_INFO_MAX_ADAPTERS + 6)]
    for i, name in enumerate(names):
        core.add_adapter(name, str(adapter_dir))
        core.add_request(req(f"r{i}", name))
    stats = step_until_one_runs(core)
    (running,) = stats.adapters.running
    waiting = [name for name in names if name != running]
    assert stats.adapters.waiting == tuple(waiting)
    assert labels(stats)["waiting_lora_adapters"] == ",".join(waiting[:LORA_INFO_MAX_ADAPTERS])


def test_engines_stats_merge_adapters_as_a_union_and_numbers_as_sums():
    """What AsyncEngine (over its models) and the Ray Serve client (over its replicas) do with engines' stats."""
    total: dict = {}
    for running, adapters in ((1, ("b", "a")), (2, ("c", "a"))):
        add_stats(total, {"running": running, "running_adapters": adapters, "waiting_adapters": ()})
    assert total == {"running": 3, "running_adapters": ("a", "b", "c"), "waiting_adapters": ()}
