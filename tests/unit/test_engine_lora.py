"""Many LoRA adapters in one batch: each request matches its adapter merged into the weights.

Engines run on the test device (--device). The fused CPU decode step's folds (lora_fold.c) and merged
copies (lora/merged.py) are CPU paths: they are asserted on the CPU only; the tokens everywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from loraplex.engine.api import GenerateRequest, ModelNotFoundError, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.lora.merge import merged_weights
from loraplex.engine.lora.peft import AdapterError, load_peft_adapter
from tests.conftest import _loaded, make_core, on_cpu, test_device
from tests.lora_factory import make_peft_dir
from tests.unit.test_engine_core import MODEL, mixed_prompts

RANKS = [4, 8, 16, 64, 4, 8, 16, 64]


def req(rid: str, ids, adapter: str | None, max_tokens: int = 16) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp, adapter=adapter)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    cfg = _loaded(MODEL).config
    root = tmp_path_factory.mktemp("adapters")
    return [make_peft_dir(root / f"a{i}", cfg, rank=r, alpha=2 * r, targets="all", seed=100 + i)
            for i, r in enumerate(RANKS)]


def merged_core(path, rounded_to: torch.dtype | None = None) -> EngineCore:
    """The adapter merged into the weights and run alone; `rounded_to`: its A and B values rounded to that
    dtype first (what 16-bit slot buffers hold of an adapter of scaling 1)."""
    base = _loaded(MODEL)
    lora = load_peft_adapter(path, base.config)
    if rounded_to is not None:
        lora = dataclasses.replace(lora, values=lora.values.to(rounded_to).float())
    loaded = dataclasses.replace(base, weights=merged_weights(base.weights, base.config, lora))
    cfg = EngineConfig(model=MODEL, device=str(test_device()), dtype="float32", num_kv_blocks=256)
    return EngineCore(cfg, loaded=loaded)


def test_mixed_batch_of_8_adapters_and_base_matches_merged_weights(adapter_dirs):
    prompts = mixed_prompts(12, seed=7)
    core = make_core()
    for i, path in enumerate(adapter_dirs):
        core.add_adapter(f"a{i}", str(path))
    adapters = [f"a{i}" for i in range(8)] + [None] * 4
    got = core.run([req(f"r{i}", p, a) for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))])
    base_alone = make_core()
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        ref = merged_core(adapter_dirs[int(a[1:])]) if a else base_alone
        want = ref.run([req(f"w{i}", p, None)])[0].token_ids
        assert got[i].token_ids == want, f"request {i} (adapter {a})"
    # the adapters really change the output
    assert got[0].token_ids != base_alone.run([req("b", prompts[0], None)])[0].token_ids


def test_an_adapter_holding_most_of_the_batch_is_folded_and_matches_merged_weights(adapter_dirs):
    """10 of 13 requests on one adapter: the fused decode step folds it into the base GEMMs (lora_fold.c,
    slots.FOLD_MIN_*) while lora.c serves the other adapter; every request still matches its reference."""
    prompts = mixed_prompts(13, seed=11)
    core = make_core()
    for i in (2, 3):
        core.add_adapter(f"a{i}", str(adapter_dirs[i]))
    adapters = ["a2", "a2", None, "a2", "a2", "a3", "a2", "a2", "a2", None, "a2", "a2", "a2"]
    got = core.run([req(f"r{i}", p, a) for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))])
    assert core.lora._folds or not on_cpu(), "the dominant adapter was never folded"
    base_alone = make_core()
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        ref = merged_core(adapter_dirs[int(a[1:])]) if a else base_alone
        assert got[i].token_ids == ref.run([req(f"w{i}", p, None)])[0].token_ids, f"request {i} (adapter {a})"


def test_an_adapter_with_rank_and_alpha_patterns_matches_its_merged_weights_folded_and_merged(tmp_path):
    """Per-module ranks (4 for q_proj, 16 for layer 1's MLP, else 8) and alphas: the adapter holds the whole
    batch, so its steps run folded into the GEMMs and, after lora_merge_after_steps, on a merged copy; a
    base-model request joins it later, sending the steps back to lora.c. Every request matches its reference."""
    cfg = _loaded(MODEL).config
    patterns = {"rank_pattern": {r"layers\.1\.mlp\..*": 16, "q_proj": 4}, "alpha_pattern": {"o_proj": 2}}
    path = make_peft_dir(tmp_path / "p", cfg, rank=8, alpha=16, targets="all", seed=7,
                         ranks=lambda layer, m: 4 if m == "q" else 16 if layer == 1 and m in ("gate", "up", "down")
                         else 8, **patterns)
    core = make_core(lora_merge_after_steps=4)
    core.add_adapter("p", str(path))
    prompts = mixed_prompts(11, seed=13)
    early = [req(f"e{i}", p, "p", max_tokens=20) for i, p in enumerate(prompts[:10])]
    late = req("late", prompts[10], None, max_tokens=6)
    tokens: dict[str, list[int]] = {}
    for r in early:
        core.add(core.prepare(r))
    while core.has_work():
        if core.num_steps == 12:
            core.add(core.prepare(late))
        for ev in core.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
    assert core.lora.r_max == 16
    assert (core.lora._folds and core.stats().adapters.merges >= 1) or not on_cpu()
    ref, base_alone = merged_core(path), make_core()
    for r in (*early, late):
        want = (ref if r.adapter else base_alone).run([req("w", r.prompt_token_ids, None, r.sampling.max_tokens)])
        assert tuple(tokens[r.request_id]) == tuple(want[0].token_ids), r.request_id
    assert tokens["e0"] != list(base_alone.run([req("b", prompts[0], None, 20)])[0].token_ids)


@pytest.mark.parametrize("lora_dtype", ["bfloat16", "float16"])
def test_16_bit_slots_match_the_merged_weights_of_the_rounded_adapters(tmp_path, lora_dtype):
    """lora_dtype under the fp32 model: each adapter is rounded to 16 bits once, as it is written into its
    slot (scaling 1 here, so the slot holds exactly the rounded file values). Every path that reads the
    slots gives the greedy tokens of those rounded weights merged into W: lora.c's widening build for the
    mixed steps, the fold of the adapter holding most of them, and the merged copy once one adapter holds
    every step."""
    cfg, dtype = _loaded(MODEL).config, getattr(torch, lora_dtype)
    paths = [make_peft_dir(tmp_path / f"h{i}", cfg, rank=r, alpha=r, targets="all", seed=300 + i)
             for i, r in enumerate((8, 16, 4))]
    core = make_core(lora_dtype=lora_dtype, lora_merge_after_steps=4)
    for i, path in enumerate(paths):
        core.add_adapter(f"h{i}", str(path))
    prompts = mixed_prompts(13, seed=17)
    adapters = ["h0", "h1", "h0", "h0", None, "h0", "h2", "h0", "h0", "h0", None, "h0", "h0"]
    got = core.run([req(f"r{i}", p, a) for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))])
    assert core.lora.dtype == dtype and (core.lora._folds or not on_cpu())
    assert {t.dtype for layer in (*core.lora.lora_a, *core.lora.lora_b) for t in layer.values()} == {dtype}
    alone = core.run([req(f"m{i}", p, "h1", max_tokens=12) for i, p in enumerate(prompts[:3])])
    assert core.stats().adapters.merges >= 1 or not on_cpu()
    refs, base_alone = {f"h{i}": merged_core(p, rounded_to=dtype) for i, p in enumerate(paths)}, make_core()
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        want = (refs[a] if a else base_alone).run([req(f"w{i}", p, None)])[0].token_ids
        assert got[i].token_ids == want, f"request {i} (adapter {a})"
    for i, p in enumerate(prompts[:3]):
        assert alone[i].token_ids == refs["h1"].run([req(f"a{i}", p, None, max_tokens=12)])[0].token_ids
    assert got[0].token_ids != base_alone.run([req("b", prompts[0], None)])[0].token_ids


def test_a_larger_rank_arriving_mid_run_grows_the_buffers_and_every_request_matches(adapter_dirs):
    """A rank-4 adapter runs (folded: it holds the batch) while a rank-64 one is loaded for a later
    request: the slot buffers grow from rank 8 to 64 between steps, and tokens still match the merged
    references, for requests that started before the growth and after it."""
    core = make_core(max_loras=2, max_lora_rank=64)
    core.add_adapter("a0", str(adapter_dirs[0]))  # rank 4
    core.add_adapter("a3", str(adapter_dirs[3]))  # rank 64
    prompts = mixed_prompts(11, seed=12)
    early = [req(f"e{i}", p, "a0", max_tokens=24) for i, p in enumerate(prompts[:10])]
    late = req("late", prompts[10], "a3", max_tokens=8)
    tokens: dict[str, list[int]] = {}

    def step():
        for ev in core.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)

    for r in early:
        core.add(core.prepare(r))
    for _ in range(4):
        step()
    assert core.lora.r_max == 8 and (core.lora._folds or not on_cpu())
    core.add(core.prepare(late))
    while core.has_work():
        step()
    assert core.lora.r_max == 64
    for r in (*early, late):
        ref = merged_core(adapter_dirs[0 if r.adapter == "a0" else 3])
        want = ref.run([req("w", r.prompt_token_ids, None, max_tokens=r.sampling.max_tokens)])[0].token_ids
        assert tuple(tokens[r.request_id]) == tuple(want), r.request_id


def test_decode_steps_reuse_the_batch_index_until_the_batch_changes(adapter_dirs):
    """The runner builds a step's LoRA batch index (and its slot groups) once per batch composition:
    decode steps over the same requests share it, and a request leaving gives the next step a new index
    that describes the new batch."""
    core = make_core()
    core.add_adapter("a1", str(adapter_dirs[1]))
    core.add_adapter("a2", str(adapter_dirs[2]))
    prompts = mixed_prompts(5, seed=13)
    plan = [("a1", 4), ("a2", 8), (None, 8), ("a1", 4), ("a2", 8)]
    seen = []  # (token slots, index) of each step that ran adapters
    step_lora = core.runner._step_lora

    def record(token_slots):
        lora = step_lora(token_slots)
        seen.append((list(token_slots), lora.index))
        return lora

    core.runner._step_lora = record
    core.run([req(f"r{i}", p, a, max_tokens=n) for i, (p, (a, n)) in enumerate(zip(prompts, plan, strict=True))])
    decodes = [(slots, index) for slots, index in seen if len(slots) <= len(plan)]
    assert len(decodes) >= 6
    for (slots, index), (prev_slots, prev_index) in zip(decodes[1:], decodes, strict=False):
        assert (index is prev_index) == (slots == prev_slots), (slots, prev_slots)
    assert len({id(index) for _, index in decodes}) == 2  # all five requests, then the three left
    for slots, index in seen:
        assert index.token_slots.tolist() == slots


def test_more_adapters_than_slots_all_complete_correctly(adapter_dirs):
    core = make_core(max_loras=2, max_lora_rank=64)
    for i, path in enumerate(adapter_dirs[:6]):
        core.add_adapter(f"a{i}", str(path))
    prompts = mixed_prompts(12, seed=8)
    got = core.run([req(f"r{i}", p, f"a{i % 6}") for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        want = merged_core(adapter_dirs[i % 6]).run([req("w", p, None)])[0].token_ids
        assert got[i].token_ids == want
    stats = core.stats()  # what /metrics reports: slot loads, how many read the disk, their time
    assert stats.adapters.evictions > 0 and stats.adapters.loads >= 6 and stats.adapters.load_seconds > 0
    # registering parsed all six into the CPU tier (32 by default): no slot load read the disk
    assert stats.adapters.disk_loads == 0 and stats.adapters.loads == core.lora.stats.cpu_hits
    assert core.pool.num_free == core.pool.num_blocks


def test_pinned_adapter_is_never_evicted(adapter_dirs):
    core = make_core(max_loras=2, max_lora_rank=64)
    for i, path in enumerate(adapter_dirs[:5]):
        core.add_adapter(f"a{i}", str(path))
    core.pin_adapter("a0")
    slot = core.lora.slot_of("a0")
    core.run([req(f"r{i}", [1, 2, 3], f"a{1 + i % 4}") for i in range(8)])
    assert core.lora.stats.evictions > 0
    assert core.lora.slot_of("a0") == slot


@pytest.mark.parametrize("breakage", ["pickle", "no_config", "rank", "target", "shape", "nan", "modules_to_save"])
def test_bad_adapter_is_refused_and_engine_keeps_serving(tmp_path, adapter_dirs, breakage):
    import torch
    from safetensors.torch import load_file, save_file

    cfg = _loaded(MODEL).config
    path = make_peft_dir(tmp_path / "bad", cfg, rank=8, alpha=16, targets=["q", "v"], seed=1)
    weights = path / "adapter_model.safetensors"
    config = path / "adapter_config.json"
    if breakage == "pickle":
        weights.rename(path / "adapter_model.bin")
    elif breakage == "no_config":
        config.unlink()
    elif breakage == "rank":
        path = make_peft_dir(tmp_path / "big", cfg, rank=128, alpha=16, targets=["q"], seed=1)
    elif breakage == "target":
        path = make_peft_dir(tmp_path / "tgt", cfg, rank=8, alpha=16, targets=["q"], seed=1,
                             target_modules=["q_proj", "lm_head"])
    elif breakage in ("shape", "nan"):
        tensors = load_file(weights)
        key = next(k for k in tensors if "lora_A" in k)
        tensors[key] = torch.full((8, 7), float("nan")) if breakage == "shape" else tensors[key] * float("nan")
        save_file(tensors, weights)
    elif breakage == "modules_to_save":
        path = make_peft_dir(tmp_path / "mts", cfg, rank=8, alpha=16, targets=["q"], seed=1,
                             modules_to_save=["lm_head"])
    core = make_core()
    core.add_adapter("good", str(adapter_dirs[0]))
    with pytest.raises(AdapterError) as info:
        core.add_adapter("bad", str(path))
    assert info.value.message
    with pytest.raises(ModelNotFoundError):
        core.add_request(req("x", [1, 2], "bad"))
    done = core.run([req("ok", [1, 2, 3], "good"), req("base", [1, 2, 3], None)])
    assert all(len(c.token_ids) == 16 for c in done)


def step_events(core, prompts, adapters) -> dict[str, list]:
    """Adds request r<i> (prompts[i], adapters[i]) for each i and steps until all end: their events by id."""
    for i, a in enumerate(adapters):
        core.add(core.prepare(req(f"r{i}", prompts[i], a)))
    events: dict[str, list] = {}
    while core.has_work():
        for ev in core.step():
            events.setdefault(ev.request_id, []).append(ev)
    return events


def test_an_adapter_whose_files_vanish_fails_only_its_requests(tmp_path, adapter_dirs):
    """An adapter read again from disk (it left the CPU tier) after its directory went away: its request
    ends with an error naming it, the others in the same steps finish as usual, no KV block or slot is
    lost, and once the files are back the adapter serves again."""
    import shutil

    path = shutil.copytree(adapter_dirs[1], tmp_path / "a1")
    core = make_core(max_loras=2, max_cpu_loras=1)
    core.add_adapter("gone", str(path))
    core.add_adapter("a0", str(adapter_dirs[0]))  # the CPU tier (1) now holds a0 only: "gone" re-reads disk
    shutil.move(path, tmp_path / "elsewhere")
    prompts = mixed_prompts(3, seed=21)
    events = step_events(core, prompts, ("gone", "a0", None))
    failed = events["r0"][-1]
    assert len(events["r0"]) == 1 and failed.finish_reason == "error" and not failed.token_ids
    assert "adapter 'gone' cannot be loaded" in failed.error and "not a directory" in failed.error
    assert failed.usage.completion_tokens == 0
    for rid, a in (("r1", "a0"), ("r2", None)):
        want = (merged_core(adapter_dirs[0]) if a else make_core()).run([req("w", prompts[int(rid[1])], None)])
        assert [t for ev in events[rid] for t in ev.token_ids] == want[0].token_ids
    assert core.pool.num_free == core.pool.num_blocks and core.lora.refcount("gone") == 0
    shutil.move(tmp_path / "elsewhere", path)
    again = core.run([req("back", prompts[0], "gone")])[0]
    assert again.finish_reason == "length"
    assert again.token_ids == merged_core(adapter_dirs[1]).run([req("w", prompts[0], None)])[0].token_ids


def test_an_adapter_whose_files_are_rewritten_fails_until_registered_again(tmp_path, adapter_dirs):
    """A registration serves the files as they were registered. Rewritten in place (same path, other
    weights), they are not picked up halfway, by whichever request next reads them from disk, beside KV
    and slots computed from the old ones: the adapter's requests fail naming it, the others run, and once
    registered again it serves the new weights."""
    import shutil

    path = shutil.copytree(adapter_dirs[1], tmp_path / "x")
    core = make_core(max_loras=2, max_cpu_loras=1)
    core.add_adapter("x", str(path))
    core.add_adapter("a0", str(adapter_dirs[0]))  # the CPU tier (1) now holds a0 only: "x" re-reads disk
    for file in adapter_dirs[2].iterdir():
        shutil.copyfile(file, path / file.name)  # in place: same files, new contents
    prompts = mixed_prompts(2, seed=23)
    events = step_events(core, prompts, ("x", "a0"))
    failed = events["r0"][-1]
    assert failed.finish_reason == "error" and not failed.token_ids
    assert "adapter 'x'" in failed.error and "changed since it was registered" in failed.error
    want = merged_core(adapter_dirs[0]).run([req("w", prompts[1], None)])[0].token_ids
    assert [t for ev in events["r1"] for t in ev.token_ids] == want
    assert core.pool.num_free == core.pool.num_blocks and core.lora.refcount("x") == 0
    core.remove_adapter("x")
    core.add_adapter("x", str(path))
    again = core.run([req("again", prompts[0], "x")])[0]
    assert again.token_ids == merged_core(adapter_dirs[2]).run([req("w", prompts[0], None)])[0].token_ids


def test_a_bad_first_adapter_leaves_no_slot_buffers(tmp_path, adapter_dirs):
    """The slot buffers (what the model pool counts against its budget) come with the first adapter that
    registers, not with one that is refused."""
    path = make_peft_dir(tmp_path / "bad", _loaded(MODEL).config, rank=8, alpha=16, targets=["q"], seed=1)
    (path / "adapter_config.json").unlink()
    core = make_core()
    with pytest.raises(AdapterError):
        core.add_adapter("bad", str(path))
    assert core.lora is None and core.runner.lora_slots is None and core.scheduler.adapters is None
    core.add_adapter("good", str(adapter_dirs[0]))
    assert core.lora is not None and "good" in core.lora
    assert len(core.run([req("ok", [1, 2, 3], "good")])[0].token_ids) == 16


def test_remove_adapter_waits_for_its_requests(adapter_dirs):
    async def go():
        engine = AsyncEngine(make_core())
        try:
            engine.add_adapter("a0", str(adapter_dirs[0]))
            stream = engine.generate(req("long", [1, 2, 3], "a0", max_tokens=1500))
            first = await stream.__anext__()
            removal = asyncio.ensure_future(engine.remove_adapter("a0"))
            # until the engine loop takes the removal (at its next step; no fixed sleep to outlast)
            entry, deadline = engine.pool.models[engine.default_model], time.monotonic() + 10
            while "a0" not in entry.removing:
                assert time.monotonic() < deadline, "the engine loop never took the removal"
                await asyncio.sleep(0.001)
            assert not removal.done()  # its request still runs: 1500 tokens, one step gone at most
            second = await stream.__anext__()
            assert not second.finished
            with pytest.raises(ModelNotFoundError):
                engine.generate(req("new", [1, 2, 3], "a0"))
            rest = [e async for e in stream]
            await asyncio.wait_for(removal, 10)
            assert sum(len(e.token_ids) for e in [first, second, *rest]) == 1500
            assert "a0" not in engine.core.lora
        finally:
            engine.shutdown()

    asyncio.run(go())


def test_an_adapter_id_registered_again_with_other_weights_never_reuses_the_old_weights_kv(adapter_dirs):
    """The prefix cache keys a block on the adapter as well as its tokens. An id removed and registered
    again names other weights, so the KV its prompt left under the old weights must not be hit: the
    second run must equal a fresh engine's run of the new adapter, not the old adapter's cached prefix."""
    prompt = [t for p in mixed_prompts(4, seed=5) for t in p]  # several full blocks, cached after the run
    assert len(prompt) >= 48
    core = make_core()
    core.add_adapter("x", str(adapter_dirs[1]))
    first = core.run([req("old", prompt, "x")])[0].token_ids
    core.remove_adapter("x")
    core.add_adapter("x", str(adapter_dirs[2]))
    hits_before = core.stats().kv.prefix_hit_tokens
    got = core.run([req("new", prompt, "x")])[0].token_ids
    fresh = make_core()
    fresh.add_adapter("x", str(adapter_dirs[2]))
    want = fresh.run([req("want", prompt, "x")])[0].token_ids
    assert got == want
    assert got != first  # the two adapters differ on this prompt, so a stale hit would show
    assert core.stats().kv.prefix_hit_tokens == hits_before
    # the new registration's own KV is cached as usual: the same prompt now hits it
    again = core.run([req("again", prompt, "x")])[0].token_ids
    assert again == want and core.stats().kv.prefix_hit_tokens > hits_before
