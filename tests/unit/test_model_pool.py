"""Several base models under one memory budget: LRU multiplexing, tiers, pinning, errors."""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import replace

import pytest
import torch

from loraplex.engine.api import GenerateRequest, InvalidRequestError, ModelNotFoundError, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.models.layer_ops import weight_copies
from loraplex.engine.pool import ModelPool, adapter_device_bytes
from tests.conftest import _loaded
from tests.lora_factory import make_peft_dir

SMALL = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=32)
# Adapter memory the tiny model's budget can hold (the defaults, 8 slots at rank 64, take 6x its weights).
FEW_LORAS = replace(SMALL, max_loras=2, max_lora_rank=8)
NAMES = ["m1", "m2", "m3"]


def host_bytes() -> int:
    """One model's weights, what the CPU tier holds."""
    return _loaded("synthetic:tiny").config.num_params() * 4


def model_bytes() -> int:
    """What the pool counts for one resident model: weights (twice with the CPU kernels' packed
    copy) and the KV pool."""
    copies = weight_copies(torch.device("cpu"), torch.float32)
    return host_bytes() * copies + 32 * 16 * _loaded("synthetic:tiny").config.kv_bytes_per_token(SMALL.torch_dtype)


def make_pool(fit: float = 2.5, cpu_fit: float = 10.0, config: EngineConfig = SMALL, budget: int = 0) -> ModelPool:
    pool = ModelPool(memory_budget=budget or int(fit * model_bytes()), cpu_budget_bytes=int(cpu_fit * host_bytes()),
                     device="cpu")
    for i, name in enumerate(NAMES):
        pool.register_model(name, f"synthetic:tiny:{i + 1}", config=config)
    return pool


def req(rid: str, model: str, max_tokens: int = 8, adapter: str | None = None) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, model, prompt_token_ids=(3, 1, 4, 1, 5), sampling=sp, adapter=adapter)


def run(pool: ModelPool, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    """Submits every request and steps the pool until all finish (loads run on their thread); none may fail."""
    out = run_events(pool, reqs)
    for events in out.values():
        assert events[-1].finish_reason != "error", events[-1].error
    return {rid: [t for e in events for t in e.token_ids] for rid, events in out.items()}


def run_events(pool: ModelPool, reqs: list[GenerateRequest]) -> dict[str, list]:
    """As run(), but returns each request's events, an error ending included."""
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        pool.submit(*pool.prepare(r))
    pending = set(out)
    deadline = time.monotonic() + 120
    while pending:
        assert time.monotonic() < deadline, "pool did not finish"
        if not pool.runnable():
            time.sleep(0.005)
            continue
        for e in pool.step():
            if e.request_id not in out:
                continue  # another test request still in flight
            out[e.request_id].append(e)
            if e.finished:
                pending.discard(e.request_id)
    return out


def alone(name: str, seed: int, rid: str, max_tokens: int = 8) -> list[int]:
    core = EngineCore(EngineConfig(model=f"synthetic:tiny:{seed}", device="cpu", dtype="float32", num_kv_blocks=32))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return core.run([GenerateRequest(rid, f"synthetic:tiny:{seed}", prompt_token_ids=(3, 1, 4, 1, 5),
                                     sampling=sp)])[0].token_ids


def test_three_models_in_a_budget_for_two_rotate_lru_and_reload_identically():
    pool = make_pool()
    want = {name: alone(name, i + 1, "x") for i, name in enumerate(NAMES)}
    assert len({tuple(v) for v in want.values()}) == 3  # three really different models
    first = run(pool, [req("a1", "m1")])
    run(pool, [req("b1", "m2")])
    assert {n: s["tier"] for n, s in pool.stats().items()} == {"m1": "device", "m2": "device", "m3": "cpu"}
    run(pool, [req("c1", "m3")])  # m1 is the least recently used: it goes
    tiers = {n: s["tier"] for n, s in pool.stats().items()}
    assert tiers == {"m1": "cpu", "m2": "device", "m3": "device"}
    again = run(pool, [req("a2", "m1")])  # m2 goes now
    assert again["a2"] == first["a1"] == want["m1"]
    assert pool.stats()["m2"]["tier"] == "cpu"
    rotating = run(pool, [req(f"r{i}", NAMES[i % 3]) for i in range(9)])
    assert all(rotating[f"r{i}"] == want[NAMES[i % 3]] for i in range(9))
    assert sum(s["evictions"] for s in pool.stats().values()) >= 3
    assert pool.stats()["m1"]["loads"]["cpu"] >= 1


def test_busy_model_is_not_evicted_even_when_least_recently_used():
    pool = make_pool()
    pool.submit(*pool.prepare(req("long", "m1", max_tokens=200)))
    while pool.models["m1"].core is None or not pool.models["m1"].core.scheduler.running:
        pool.step() if pool.runnable() else time.sleep(0.005)
    # Blocking loads step nothing, so "long" cannot run out during them: only the eight steps of
    # m2's request advance it (stepping through background loads let a slow machine finish it).
    pool.load("m2")
    run(pool, [req("b", "m2")])  # m2 is now used later than m1: m1 is the least recently used
    assert "long" in pool.in_flight()
    pool.load("m3")  # room must come from m2, the idle one, not from busy m1
    tiers = {n: s["tier"] for n, s in pool.stats().items()}
    assert tiers["m1"] == "device" and tiers["m2"] != "device" and tiers["m3"] == "device"
    assert "long" in pool.in_flight()
    pool.abort("long")


def test_pinned_model_is_never_evicted():
    pool = make_pool()
    pool.pin("m1")
    run(pool, [req("a", "m1")])
    for i in range(4):
        run(pool, [req(f"b{i}", "m2"), req(f"c{i}", "m3")][i % 2:i % 2 + 1])
    assert pool.stats()["m1"]["tier"] == "device" and pool.stats()["m1"]["evictions"] == 0


def test_cpu_tier_is_bounded_and_falls_back_to_disk():
    pool = make_pool(cpu_fit=1.2)  # room for one model's weights in host memory
    tiers = [s["tier"] for s in pool.stats().values()]
    assert tiers.count("cpu") == 1 and tiers.count("disk") == 2
    out = run(pool, [req("a", "m1"), req("b", "m2"), req("c", "m3")])
    assert [out[k] for k in "abc"] == [alone(n, i + 1, "x") for i, n in enumerate(NAMES)]
    loads = {n: s["loads"] for n, s in pool.stats().items()}
    assert sum(v["disk"] for v in loads.values()) >= 2


def test_errors_are_clear_and_other_models_keep_serving(tmp_path):
    pool = make_pool()
    with pytest.raises(ModelNotFoundError):
        pool.prepare(req("x", "nope"))
    with pytest.raises(InvalidRequestError, match="budget"):
        pool.register_model("huge", "synthetic:small", config=SMALL)
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(InvalidRequestError, match="broken.gguf"):
        pool.register_model("broken", str(bad), config=SMALL)
    assert set(pool.models) == set(NAMES)
    assert run(pool, [req("ok", "m2")])["ok"] == alone("m2", 2, "x")


def test_adapters_belong_to_their_model_and_survive_eviction(tmp_path):
    pool = make_pool(config=FEW_LORAS)
    path = make_peft_dir(tmp_path / "ad", _loaded("synthetic:tiny").config, rank=8, alpha=16, targets="all", seed=9)
    pool.add_adapter("m1", "ad", str(path))  # validated while m1 is not even loaded
    with pytest.raises(ModelNotFoundError):
        pool.prepare(req("x", "m2", adapter="ad"))
    before = run(pool, [req("a1", "m1", adapter="ad")])["a1"]
    run(pool, [req("b", "m2")])
    run(pool, [req("c", "m3")])  # m1 evicted: its adapter slots went with it
    assert pool.stats()["m1"]["tier"] != "device"
    after = run(pool, [req("a2", "m1", adapter="ad")])["a2"]
    assert after == before != run(pool, [req("a3", "m1")])["a3"]


def test_a_model_reloads_without_reading_its_adapters_and_a_broken_one_fails_only_its_requests(tmp_path):
    """A model coming back from the CPU tier or disk registers its adapters as they were registered,
    without reading them (its reload does not grow with its fleet; each adapter is read on its first
    request, and must be the files it was registered as). An adapter whose files went away meanwhile
    fails only its own requests: it used to fail the model's load, and with it every request waiting
    on the model, base-model ones included."""
    pool = make_pool(config=FEW_LORAS)
    good, gone = tiny_adapter(tmp_path, "good"), make_peft_dir(
        tmp_path / "gone", _loaded("synthetic:tiny").config, rank=4, alpha=8, targets="all", seed=10)
    pool.add_adapter("m1", "good", str(good))
    pool.add_adapter("m1", "gone", str(gone))
    want = run(pool, [req("a", "m1", adapter="good"), req("g", "m1", adapter="gone"), req("b", "m1")])
    run(pool, [req("c", "m2")])
    run(pool, [req("d", "m3")])  # m1 evicted, its adapters' slots and CPU tier with it
    assert pool.stats()["m1"]["tier"] != "device"
    shutil.move(gone, tmp_path / "elsewhere")
    got = run_events(pool, [req("a2", "m1", adapter="good"), req("g2", "m1", adapter="gone"), req("b2", "m1")])
    assert [t for e in got["a2"] for t in e.token_ids] == want["a"]
    assert [t for e in got["b2"] for t in e.token_ids] == want["b"]
    failed = got["g2"][-1]
    assert failed.finish_reason == "error" and "adapter 'gone'" in failed.error and "not a directory" in failed.error
    core = pool.models["m1"].core
    assert core.stats().adapters.disk_loads == 1  # "good", on its request; the reload itself read none
    shutil.move(tmp_path / "elsewhere", gone)  # the same files back: the adapter serves again
    assert run(pool, [req("g3", "m1", adapter="gone")])["g3"] == want["g"]


def test_async_engine_serves_several_models():
    pool = make_pool()

    async def go():
        engine = AsyncEngine(pool)
        try:
            assert [m.name for m in engine.models()] == NAMES

            async def one(rid, model):
                return [t for e in [e async for e in engine.generate(req(rid, model))] for t in e.token_ids]

            return await asyncio.gather(*(one(f"q{i}", NAMES[i % 3]) for i in range(6)))
        finally:
            engine.shutdown()

    got = asyncio.run(go())
    want = [alone(n, i + 1, "x") for i, n in enumerate(NAMES)]
    assert got == want + want


def tiny_adapter(tmp_path, name: str = "ad"):
    return make_peft_dir(tmp_path / name, _loaded("synthetic:tiny").config, rank=8, alpha=16, targets="all", seed=9)


def adapter_bytes(config: EngineConfig) -> int:
    return adapter_device_bytes(config, _loaded("synthetic:tiny").config, torch.device("cpu"))


def test_a_models_first_adapter_makes_room_for_its_adapter_memory(tmp_path):
    """Two resident models fill the budget; m1's first adapter needs its slot buffers (and, with the CPU
    kernels, folds and a merged copy) on top, so idle m2 is evicted then and the pool never holds more
    than its budget."""
    extra = adapter_bytes(FEW_LORAS)
    pool = make_pool(config=FEW_LORAS, budget=2 * model_bytes() + extra // 2)
    pool.load("m1")
    pool.load("m2")
    assert pool.stats()["m1"]["device_bytes"] == model_bytes()
    pool.add_adapter("m1", "ad", str(tiny_adapter(tmp_path)))
    stats = pool.stats()
    assert stats["m1"]["device_bytes"] == model_bytes() + extra
    assert stats["m1"]["tier"] == "device" and stats["m2"]["tier"] != "device"
    assert sum(s["device_bytes"] for s in stats.values() if s["tier"] == "device") <= pool.budget
    out = run(pool, [req("a", "m1", adapter="ad"), req("b", "m1")])
    assert out["a"] != out["b"] == alone("m1", 1, "x")
    pool.load("m2")  # m1 (idle) goes now, its adapter memory with it
    assert pool.stats()["m1"]["tier"] != "device" and pool.stats()["m1"]["device_bytes"] == model_bytes() + extra


def test_adapters_the_budget_can_never_hold_are_refused_and_nothing_is_registered(tmp_path):
    pool = make_pool(fit=1.5)  # the defaults' adapter memory is 6x the tiny model's weights
    pool.load("m1")
    with pytest.raises(InvalidRequestError, match=r"adapter memory .*max_loras 8 at max_lora_rank 64"):
        pool.add_adapter("m1", "ad", str(tiny_adapter(tmp_path)))
    assert not pool.models["m1"].adapters and pool.models["m1"].core.lora is None
    with pytest.raises(ModelNotFoundError):
        pool.prepare(req("x", "m1", adapter="ad"))
    assert run(pool, [req("ok", "m1")])["ok"] == alone("m1", 1, "x")


def test_adapter_memory_never_evicts_a_pinned_model(tmp_path):
    """Room for adapter memory is made from idle, unpinned models only; else the adapter is refused at
    once (an adapter upload does not wait on other tenants' traffic), nothing is registered, and it can
    be added once room is free."""
    pool = make_pool(config=FEW_LORAS, budget=2 * model_bytes() + adapter_bytes(FEW_LORAS) // 2)
    pool.pin("m2")
    pool.load("m2")
    pool.load("m1")
    with pytest.raises(InvalidRequestError, match="busy or pinned models fill"):
        pool.add_adapter("m1", "ad", str(tiny_adapter(tmp_path)))
    assert not pool.models["m1"].adapters and pool.models["m1"].core.lora is None
    assert pool.stats()["m2"]["tier"] == "device"
    pool.pin("m2", False)
    pool.add_adapter("m1", "ad", str(tiny_adapter(tmp_path)))
    assert pool.stats()["m2"]["tier"] != "device" and "ad" in pool.models["m1"].adapters


def test_engine_counters_survive_a_models_eviction(tmp_path):
    """Generated tokens, steps and adapter loads are totals since start (Prometheus counters): evicting
    the model that made them must not take them back from the engine's stats."""
    pool = make_pool(config=FEW_LORAS)
    pool.add_adapter("m1", "ad", str(tiny_adapter(tmp_path)))

    async def go():
        engine = AsyncEngine(pool)
        try:
            seen = []
            for rid, model, adapter in (("a", "m1", "ad"), ("b", "m2", None), ("c", "m3", None), ("d", "m2", None)):
                async for _ in engine.generate(req(rid, model, adapter=adapter)):
                    pass
                seen.append(engine.stats())
            return seen
        finally:
            engine.shutdown()

    seen = asyncio.run(go())
    assert pool.stats()["m1"]["tier"] != "device" and seen[-1].models.evictions >= 1  # m1 and its slots left
    assert [s.requests.generated_tokens for s in seen] == [8, 16, 24, 32]
    assert all(s.adapters.loads == 1 and s.adapters.load_seconds > 0 for s in seen)
    steps = [s.requests.num_steps for s in seen]
    assert steps == sorted(steps) and len(set(steps)) == 4


def test_an_adopted_engine_bounds_prompts_by_its_own_kv_pool(monkeypatch):
    """On CUDA an engine measures its KV pool (memory.size_kv_cache); a pool that adopts it must bound prompts
    by that pool, not by the configured guess. The CPU never measures, so the measurement is stood in for."""
    import loraplex.engine.core as core_module
    from loraplex.engine.memory import DeviceMemory

    config = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32", num_kv_blocks=32, block_size=16)
    measured = lambda cfg, model, weights, max_len, graph_rows=0: DeviceMemory(  # noqa: E731
        weights=weights, kv_cache_bytes=0, num_blocks=4)
    monkeypatch.setattr(core_module, "size_kv_cache", measured)
    core = EngineCore(config, loaded=_loaded("synthetic:tiny"))
    entry = ModelPool(memory_budget=1 << 30, device="cpu").adopt(core)
    assert entry.frontend.kv_capacity == core.frontend.kv_capacity == 4 * 16
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="holds 64"):  # fits the configured 512 tokens, not the 64
        entry.frontend.prepare(GenerateRequest("long", "synthetic:tiny", prompt_token_ids=(5,) * 60, sampling=sp))
