"""Memory sizing (engine/memory.py): the arithmetic with given numbers, the config field and CLI flag, the
CPU path as before, and the measured path's wiring into the engine with the CUDA readings stubbed."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from loraplex.cli.engine_args import add_engine_args, build_engine
from loraplex.engine import memory
from loraplex.engine.config import EngineConfig
from loraplex.engine.frontend import kv_blocks
from loraplex.engine.memory import (
    DEFAULT_KV_CACHE_BYTES,
    adapter_device_bytes,
    block_bytes,
    blocks_for_bytes,
    dummy_step,
    measures_kv_cache,
    plan_memory,
)
from loraplex.engine.pool import DEFAULT_BUDGET_FRACTION, ModelPool, device_memory_bytes
from tests.conftest import _loaded, make_core

GIB, MIB = 2**30, 2**20


def test_plan_respects_the_utilization_and_subtracts_other_memory_activations_and_slots():
    # 80 GiB card at 0.9 = 72 GiB; 20 GiB in use of which 16 GiB weights (4 GiB context and others);
    # a step peaks at 2 GiB; adapter slots need 1 GiB
    m = plan_memory(80 * GIB, 0.9, 20 * GIB, weights=16 * GIB, peak_step=2 * GIB, reserved=1 * GIB, per_block=2 * MIB)
    assert m.budget == int(80 * GIB * 0.9) - 4 * GIB - 2 * GIB
    assert m.num_blocks == (m.budget - 16 * GIB - 1 * GIB) // (2 * MIB)
    assert m.kv_cache_bytes == m.num_blocks * 2 * MIB
    assert (m.total, m.utilization, m.weights, m.peak_step) == (80 * GIB, 0.9, 16 * GIB, 2 * GIB)
    half = plan_memory(80 * GIB, 0.5, 20 * GIB, weights=16 * GIB, peak_step=2 * GIB, reserved=1 * GIB,
                       per_block=2 * MIB)
    assert m.kv_cache_bytes - half.kv_cache_bytes == int(80 * GIB * 0.4)  # the fraction, and nothing else, moved
    heavier = plan_memory(80 * GIB, 0.9, 20 * GIB, weights=16 * GIB, peak_step=5 * GIB, reserved=1 * GIB,
                          per_block=2 * MIB)
    assert m.kv_cache_bytes - heavier.kv_cache_bytes == 3 * GIB  # every byte of activations comes off the cache


def test_plan_never_gives_less_than_one_block():
    # 1 MiB left, blocks of 2 MiB: one block
    m = plan_memory(100 * MIB, 1.0, 10 * MIB, weights=10 * MIB, peak_step=89 * MIB, per_block=2 * MIB)
    assert (m.num_blocks, m.kv_cache_bytes) == (1, 2 * MIB)
    assert blocks_for_bytes(0, 4096) == 1 and blocks_for_bytes(3 * 4096 + 1, 4096) == 3


def test_plan_refuses_weights_that_leave_no_room():
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization 0\.9 leaves no room for the KV cache: ") as e:
        plan_memory(16 * GIB, 0.9, 15 * GIB, weights=15 * GIB)
    assert "weights take 15360 MiB" in str(e.value)
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):  # the activations tip it over
        plan_memory(16 * GIB, 0.9, 12 * GIB, weights=12 * GIB, peak_step=2 * GIB + GIB // 2)


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -1, math.nan, math.inf])
def test_config_refuses_hostile_utilizations(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=bad)


def test_config_takes_utilizations_in_range_and_a_positive_kv_size():
    assert EngineConfig().gpu_memory_utilization == 0.9
    assert EngineConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    assert EngineConfig(gpu_memory_utilization=0.05).gpu_memory_utilization == 0.05
    with pytest.raises(ValueError, match="kv_cache_bytes must be >= 1"):
        EngineConfig(kv_cache_bytes=0)


def test_only_an_unsized_cuda_engine_measures():
    assert measures_kv_cache(EngineConfig(device="cuda"))
    assert not measures_kv_cache(EngineConfig(device="cuda", kv_cache_bytes=64 * MIB))
    assert not measures_kv_cache(EngineConfig(device="cuda", num_kv_blocks=100))
    assert not measures_kv_cache(EngineConfig(device="cpu"))


def test_the_cpu_sizes_the_kv_cache_as_before():
    model = _loaded("synthetic:tiny", "cpu").config
    config = EngineConfig(device="cpu", dtype="float32")
    per_block = config.block_size * model.kv_bytes_per_token(torch.float32)
    assert block_bytes(config, model) == per_block
    assert kv_blocks(config, model) == max(1, 512 * 1024 * 1024 // per_block)  # today's formula, 512 MiB
    sized = EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=64 * MIB)
    assert kv_blocks(sized, model) == 64 * MIB // per_block
    assert kv_blocks(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=7), model) == 7
    core = make_core(device="cpu", num_kv_blocks=None)
    assert core.pool.num_blocks == DEFAULT_KV_CACHE_BYTES // per_block
    assert core.frontend.kv_capacity == core.pool.num_blocks * config.block_size
    s = core.stats()
    assert s.memory.kv_cache_bytes == core.pool.num_blocks * per_block
    assert (s.memory.budget_bytes, s.memory.gpu_memory_utilization, s.memory.peak_step_bytes) == (0, 0.0, 0)


def test_the_pool_budget_on_the_cpu_is_unchanged():
    host = device_memory_bytes(torch.device("cpu"))
    for budget, want in ((None, int(DEFAULT_BUDGET_FRACTION * host)), (0.5, int(0.5 * host)), (123 * MIB, 123 * MIB)):
        pool = ModelPool(memory_budget=budget, device="cpu")
        assert (pool.budget, pool.memory) == (want, None)
        pool.shutdown()


def test_the_measured_path_sizes_the_engine(monkeypatch):
    """The CUDA path with its readings stubbed: the engine's pool, its frontend's capacity and its stats
    follow the measurement, with the adapter slots' size kept free."""
    seen = {}

    def measure(device, utilization, weights, peak_step, reserved, per_block):
        seen.update(utilization=utilization, weights=weights, peak_step=peak_step, reserved=reserved)
        # a 64 MiB device with the weights and 1 MiB of other memory in use
        return plan_memory(64 * MIB, utilization, weights + MIB, weights, peak_step, reserved, per_block)

    monkeypatch.setattr(memory, "measures_kv_cache", lambda config: True)
    monkeypatch.setattr(memory, "profile_step", lambda model, config, max_model_len: 3 * MIB)
    monkeypatch.setattr(memory, "measure_device_memory", measure)
    core = make_core(device="cpu", num_kv_blocks=None, gpu_memory_utilization=0.75, max_loras=2, max_lora_rank=8)
    cfg, mcfg = core.config, core.loaded.config
    per_block = block_bytes(cfg, mcfg)
    reserved = adapter_device_bytes(cfg, mcfg, torch.device("cpu"))
    assert seen == {"utilization": 0.75, "weights": core.weight_bytes, "peak_step": 3 * MIB, "reserved": reserved}
    budget = int(64 * MIB * 0.75) - MIB - 3 * MIB
    assert core.pool.num_blocks == (budget - core.weight_bytes - reserved) // per_block
    assert core.frontend.kv_capacity == core.pool.num_blocks * cfg.block_size
    s = core.stats()
    m = s.memory
    assert (m.kv_cache_bytes, m.budget_bytes, m.gpu_memory_utilization, m.peak_step_bytes) == (
        core.pool.num_blocks * per_block, budget, 0.75, 3 * MIB)


def test_the_dummy_step_runs_a_maximum_size_step_split_at_the_context_length():
    core = make_core(device="cpu")
    config = EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=40, block_size=16, max_num_seqs=4)
    kv = dummy_step(core.runner.model, config, max_model_len=24)  # sequences of 24 + 16 tokens: 2 + 1 blocks
    assert kv == 3 * block_bytes(config, core.loaded.config)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_the_cli_flag_reaches_the_engine_config():
    args = _args("--model", "synthetic:tiny", "--device", "cpu", "--gpu-memory-utilization", "0.7")
    assert args.gpu_memory_utilization == 0.7
    engine = build_engine(args)
    try:
        assert engine.core.config.gpu_memory_utilization == 0.7
        assert engine.core.config.kv_cache_bytes is None  # no --kv-cache-mb: measured on CUDA, 512 MiB here
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        build_engine(_args("--model", "synthetic:tiny", "--device", "cpu", "--gpu-memory-utilization", "1.5"))
    with pytest.raises(ValueError, match="--kv-cache-mb must be positive"):
        build_engine(_args("--model", "synthetic:tiny", "--device", "cpu", "--kv-cache-mb", "0"))
