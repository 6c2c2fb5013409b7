"""An adapter that holds every token of a run of decode steps is merged into a copy of the weights
(lora/merged.py): its requests still match the merged reference, and the copy never outlives its slot.

Merged copies are the CPU fused decode step's (packed for the C kernels): the tests that expect one are
marked cpu_kernels, skipped off the CPU; the others run on the test device (--device).
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.kernels.cpu import linear
from tests.conftest import _loaded, make_core
from tests.lora_factory import make_peft_dir
from tests.unit.test_engine_core import MODEL, mixed_prompts
from tests.unit.test_engine_lora import adapter_dirs, merged_core, req  # noqa: F401 (adapter_dirs: a fixture)


def run_all_on(core, adapter: str | None, prompts, tag: str, max_tokens: int = 12) -> list[list[int]]:
    done = core.run([req(f"{tag}{i}", p, adapter, max_tokens) for i, p in enumerate(prompts)])
    return [r.token_ids for r in done]


def reference(path, prompts) -> list[list[int]]:
    ref = merged_core(path)
    return [ref.run([req(f"w{i}", p, None, 12)])[0].token_ids for i, p in enumerate(prompts)]


@pytest.mark.cpu_kernels
def test_merged_adapter_matches_the_reference_and_follows_its_slot(adapter_dirs):  # noqa: F811
    prompts = mixed_prompts(6, seed=3)
    core = make_core(max_loras=1, lora_merge_after_steps=3)
    for name in ("a2", "a3"):
        core.add_adapter(name, str(adapter_dirs[int(name[1:])]))
    merge = core.runner.lora_merge
    assert merge is not None and merge.builds == 0

    assert run_all_on(core, "a2", prompts, "x") == reference(adapter_dirs[2], prompts)
    assert merge.builds == 1 and merge.nbytes() > 0  # 11 decode steps all on a2: merged after 3
    assert merge.steps >= 8  # and run merged from then on
    stats = core.stats()
    assert stats.adapters.merges == 1 and stats.adapters.merged_bytes == merge.nbytes()
    assert stats.adapters.slot_bytes == core.lora.nbytes() > 0

    # A mixed step (a2 with base requests) runs with LoRA work; the copy stays for a2's next run.
    merged_steps = merge.steps
    mixed = core.run([req("m0", prompts[0], "a2", 12), req("m1", prompts[1], None, 12)])
    assert mixed[0].token_ids == reference(adapter_dirs[2], prompts[:1])[0]
    assert mixed[1].token_ids == make_core().run([req("b", prompts[1], None, 12)])[0].token_ids
    assert merge.builds == 1 and merge.steps == merged_steps

    # One slot: a3 overwrites a2's slot. a2's copy must never serve a3's tokens.
    assert run_all_on(core, "a3", prompts, "y") == reference(adapter_dirs[3], prompts)
    assert merge.builds == 2
    assert run_all_on(core, "a2", prompts, "z") == reference(adapter_dirs[2], prompts)
    assert merge.builds == 3


@pytest.mark.cpu_kernels
def test_projections_the_adapter_leaves_alone_are_shared_with_the_model(tmp_path):
    cfg = _loaded(MODEL).config
    path = make_peft_dir(tmp_path / "qv", cfg, rank=8, alpha=16, targets=("q", "v"), seed=5)
    core = make_core(lora_merge_after_steps=1)
    core.add_adapter("qv", str(path))
    prompts = mixed_prompts(3, seed=9)
    assert run_all_on(core, "qv", prompts, "q") == reference(path, prompts)
    merge = core.runner.lora_merge
    assert merge.builds == 1
    merged, base = merge._layers[0], core.runner.model.layers[0]
    assert merged[1] is not base[1]  # qkv carries q and v's deltas
    assert all(merged[i] is base[i] for i in (3, 5, 6))  # o, gate_up, down: untouched, not copied
    qkv = base[1]
    assert merge.nbytes() == cfg.num_layers * qkv.data.numel() * 4


def test_short_runs_and_merging_off_build_nothing(adapter_dirs):  # noqa: F811
    prompts = mixed_prompts(4, seed=4)
    never = make_core(lora_merge_after_steps=0)
    never.add_adapter("a1", str(adapter_dirs[1]))
    assert never.runner.lora_merge is None
    late = make_core(lora_merge_after_steps=50)  # more decode steps than the run has
    late.add_adapter("a1", str(adapter_dirs[1]))
    want = reference(adapter_dirs[1], prompts)
    assert run_all_on(never, "a1", prompts, "n") == want == run_all_on(late, "a1", prompts, "l")
    assert late.runner.lora_merge.builds == 0 and late.runner.lora_merge.nbytes() == 0


def test_bad_setting_is_refused():
    with pytest.raises(ValueError, match="lora_merge_after_steps must be >= 0"):
        EngineConfig(lora_merge_after_steps=-1)


@pytest.mark.cpu_kernels
def test_a_packed_copy_without_its_weight_serves_prefill_sized_batches_itself(monkeypatch):
    """Past packed_max_rows() a weight that kept its unpacked tensor goes to MKL; a copy without one (merged
    copies, GGUF blocks) keeps the packed kernel, which serves any batch in 64-row blocks."""
    w = torch.randn(48, 32)
    packed = linear.pack(w, keep_weight=False)
    x = torch.randn(4, 32)
    small = linear.packed_linear(x, packed)
    assert torch.allclose(small, x @ w.T, atol=1e-5)
    monkeypatch.setattr(linear, "PACKED_MAX_ROWS", 2)
    assert torch.equal(linear.packed_linear(x, packed), small)
