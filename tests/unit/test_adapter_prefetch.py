"""Adapter loads off the step's path: a request's adapter is read in the background while the others decode.

The slow read is a reader held on a threading.Event: a named pipe cannot stand in for the weights file,
since the loader refuses anything but a regular file (is_file) and sizes its read by fstat.
"""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from loraplex.engine.lora import prefetch
from loraplex.engine.lora.peft import files_version
from loraplex.engine.lora.slots import LoraSlots
from tests.conftest import _loaded, make_core
from tests.lora_factory import make_peft_dir
from tests.unit.test_engine_core import MODEL, mixed_prompts
from tests.unit.test_engine_lora import req

WAIT_S = 30  # generous bound on waits for the loader thread (never reached when things work)


class HeldReader:
    """Replaces the loader's disk read: each read signals `entered`, then waits for `go` (or runs at once)."""

    def __init__(self, monkeypatch):
        self.entered, self.go, self.calls = threading.Event(), threading.Event(), 0
        real = prefetch.load_peft_adapter

        def read(*args, **kwargs):
            self.calls += 1
            self.entered.set()
            assert self.go.wait(WAIT_S), "the test never released the read"
            return real(*args, **kwargs)

        monkeypatch.setattr(prefetch, "load_peft_adapter", read)


def loader_idle(slots: LoraSlots) -> None:
    """Waits until the loader thread has run every job queued so far (it runs them in order)."""
    slots._loader.submit(lambda: None).result(timeout=WAIT_S)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return make_peft_dir(tmp_path_factory.mktemp("prefetch") / "a", _loaded(MODEL).config, rank=8, alpha=16,
                         targets="all", seed=31)


def register_unread(core, adapter_id, path) -> None:
    """Registers the adapter as a model the pool loads again does: nothing is read until a request needs it."""
    core.add_adapter(adapter_id, str(path), files_version(path))


def add(core, rid, prompt, adapter, max_tokens):
    core.add(core.prepare(req(rid, prompt, adapter, max_tokens=max_tokens)))


def collect(events, tokens: dict, finished: dict) -> None:
    for ev in events:
        tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
        if ev.finished:
            finished[ev.request_id] = ev


def test_other_requests_keep_decoding_while_an_adapter_loads(monkeypatch, adapter_dir):
    """The adapter (registered unread: in neither tier) is read from disk by the loader thread, held
    there: step after step returns while the read is blocked, the base requests gain a token each step,
    the adapter's request waits in its place; once the read finishes it runs, with the tokens of a run
    whose adapter was loaded beforehand."""
    prompts = mixed_prompts(3, seed=41)
    core = make_core()
    register_unread(core, "a", adapter_dir)
    reader = HeldReader(monkeypatch)
    add(core, "b0", prompts[0], None, 12)
    add(core, "b1", prompts[1], None, 12)
    add(core, "x", prompts[2], "a", 8)
    assert reader.entered.wait(WAIT_S) and core.lora.loading("a")  # started at admission, before any step
    tokens, finished = {}, {}
    for n in range(1, 6):
        collect(core.step(), tokens, finished)  # returns although the read is still blocked
        assert core.lora.loading("a") and not reader.go.is_set()
        assert len(tokens["b0"]) == len(tokens["b1"]) == n  # the others decode every step
        assert "x" not in tokens and core.lora.slot_of("a") is None
    assert core.scheduler.waiting and reader.calls == 1
    reader.go.set()
    while core.has_work():
        collect(core.step(), tokens, finished)
    assert reader.calls == 1 and not core.lora.loading("a")
    assert finished["x"].finish_reason == "length" and len(tokens["x"]) == 8

    preloaded = make_core()
    preloaded.add_adapter("a", str(adapter_dir))
    preloaded.lora.pin("a")
    want = preloaded.run([req("x", prompts[2], "a", max_tokens=8)])[0].token_ids
    assert tokens["x"] == want
    base = make_core().run([req(f"b{i}", prompts[i], None, max_tokens=12) for i in range(2)])
    assert [tokens["b0"], tokens["b1"]] == [c.token_ids for c in base]
    assert core.pool.num_free == core.pool.num_blocks and core.lora.refcount("a") == 0


def test_a_failed_background_load_ends_only_its_request(monkeypatch, tmp_path, adapter_dir):
    """The adapter's files vanish; its background read fails while the others decode: the next step ends
    that request with an error naming the adapter, the others run on, and nothing is left waiting."""
    path = shutil.copytree(adapter_dir, tmp_path / "gone")
    core = make_core()
    register_unread(core, "gone", path)
    shutil.move(path, tmp_path / "elsewhere")
    reader = HeldReader(monkeypatch)
    prompts = mixed_prompts(2, seed=42)
    add(core, "b", prompts[0], None, 6)
    add(core, "x", prompts[1], "gone", 6)
    assert reader.entered.wait(WAIT_S)
    tokens, finished = {}, {}
    collect(core.step(), tokens, finished)
    collect(core.step(), tokens, finished)
    assert len(tokens["b"]) == 2 and "x" not in tokens
    reader.go.set()
    loader_idle(core.lora)
    collect(core.step(), tokens, finished)
    assert finished["x"].finish_reason == "error" and not tokens["x"]
    assert "adapter 'gone' cannot be loaded" in finished["x"].error and "not a directory" in finished["x"].error
    while core.has_work():
        collect(core.step(), tokens, finished)
    assert finished["b"].finish_reason == "length" and len(tokens["b"]) == 6
    assert core.pool.num_free == core.pool.num_blocks and core.lora.refcount("gone") == 0
    assert not core.lora._load_errors and not core.lora.loading("gone")


def test_unregistering_an_adapter_while_its_prefetch_runs_leaves_nothing_behind(monkeypatch, adapter_dir):
    """The read finishes after the adapter is gone: its result is dropped, not parked or cached; the id
    registered again is read afresh and serves its weights."""
    core = make_core()
    register_unread(core, "a", adapter_dir)
    reader = HeldReader(monkeypatch)
    add(core, "x", [1, 2, 3], "a", 4)
    assert reader.entered.wait(WAIT_S)
    core.abort("x")
    assert core.remove_adapter("a") and "a" not in core.lora
    reader.go.set()
    loader_idle(core.lora)
    slots = core.lora
    for state in (slots._pending, slots._ready, slots._load_errors, slots._cpu, slots._images, slots._loaded):
        assert "a" not in state
    assert slots.stats.loads == 0 and not core.has_work()
    register_unread(core, "a", adapter_dir)
    got = core.run([req("again", [1, 2, 3], "a", max_tokens=4)])[0]
    assert reader.calls == 2 and got.finish_reason == "length"


def test_prefetch_of_an_adapter_in_the_cpu_tier_or_a_slot_does_nothing(monkeypatch, tmp_path):
    config = _loaded(MODEL).config
    path = make_peft_dir(tmp_path / "a", config, rank=4, alpha=8, targets=["q", "v"], seed=3)
    cached = LoraSlots(config, max_loras=1, max_lora_rank=8, max_cpu_loras=1, background=True)
    cached.register("a", path)  # parsed into the CPU tier
    in_slot = LoraSlots(config, max_loras=1, max_lora_rank=8, max_cpu_loras=0, background=True)
    in_slot.register("a", path)
    reader = HeldReader(monkeypatch)
    reader.go.set()
    assert in_slot.acquire("a") is None and in_slot.loading("a")  # not in either tier: read in the background
    loader_idle(in_slot)
    assert in_slot.acquire("a") == 0 and reader.calls == 1
    for slots in (cached, in_slot):
        assert slots.prefetch("a") is False and not slots.loading("a")
    assert cached.acquire("a") == 0  # from the CPU tier, at once
    loader_idle(cached)
    loader_idle(in_slot)
    assert reader.calls == 1 and cached.stats.disk_loads == 0 and in_slot.stats.disk_loads == 1
    assert not cached._ready and not in_slot._ready


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_slot_writes_equal_the_direct_writes(tmp_path, dtype):
    """The slot images (what the CPU tier keeps on CUDA, copied without blocking) fill a slot exactly as
    the direct write does: several ranks and targets through one slot (stale rows zeroed), rank and alpha
    patterns, buffer growth. Run on the CPU by forcing the staged path."""
    config = _loaded(MODEL).config
    paths = [make_peft_dir(tmp_path / "a", config, rank=8, alpha=16, targets=["q", "v"], seed=1),
             make_peft_dir(tmp_path / "b", config, rank=4, alpha=8, targets="all", seed=2),
             make_peft_dir(tmp_path / "c", config, rank=8, alpha=16, targets=["q", "v", "down"], seed=3,
                           ranks=lambda layer, m: 4 if m == "q" else 12 if (layer, m) == (1, "down") else 8,
                           rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.down_proj": 12},
                           alpha_pattern={"v_proj": 24}),
             make_peft_dir(tmp_path / "d", config, rank=16, alpha=16, targets=["o", "up"], seed=4)]
    both = []
    for staged in (False, True):
        slots = LoraSlots(config, max_loras=1, max_lora_rank=16, max_cpu_loras=4, dtype=dtype)
        slots._staged = staged
        for i, path in enumerate(paths):
            slots.register(f"a{i}", path)
        assert bool(slots._images) == staged
        seen = []
        for i in (0, 1, 2, 3, 1):
            assert slots.acquire(f"a{i}") == 0
            slots.release(f"a{i}")
            seen.append([t.clone() for layer in (*slots.lora_a, *slots.lora_b) for t in layer.values()])
        both.append(seen)
    for direct, staged in zip(*both, strict=True):
        assert all(torch.equal(d, s) for d, s in zip(direct, staged, strict=True))


def test_an_engine_waiting_only_on_a_read_sleeps_until_it_ends(monkeypatch, adapter_dir):
    """When every waiting request waits on an adapter's background read, the engine is not runnable (its
    loop sleeps instead of spinning step after empty step); the read's end wakes it, once."""
    core = make_core()
    register_unread(core, "a", adapter_dir)
    woken = []
    core.wake = lambda: woken.append(True)
    reader = HeldReader(monkeypatch)
    add(core, "x", mixed_prompts(1, seed=43)[0], "a", 4)
    assert core.runnable()
    assert reader.entered.wait(WAIT_S)
    assert core.step() == [] and core.has_work()
    assert not core.runnable() and not woken  # nothing to run until the read ends
    add(core, "b", mixed_prompts(1, seed=44)[0], None, 4)
    assert core.runnable()  # a new request may run at once
    core.step()
    reader.go.set()
    loader_idle(core.lora)
    assert woken == [True] and core.runnable()
    tokens, finished = {}, {}
    while core.has_work():
        collect(core.step(), tokens, finished)
    assert set(finished) == {"x", "b"} and len(tokens["x"]) == 4
