"""The attention backends: the registry's choices and refusals, and whole-engine greedy tokens
identical across torch_sdpa, cpu_c and triton_paged (the Triton kernels in the interpreter on the CPU)
with adapters, prefix-cache hits, chunked prefill and speculative drafts in the batch."""

from __future__ import annotations

import re

import pytest
import torch

from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.attention.registry import BACKENDS, attention_backend, auto_backend
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from tests.conftest import _loaded, make_core, on_cpu
from tests.lora_factory import make_peft_dir
from tests.unit.test_engine_core import MODEL, mixed_prompts

CPU = torch.device("cpu")


def test_auto_picks_by_device_and_dtype():
    assert auto_backend(CPU, torch.float32, 64) == "cpu_c"
    assert auto_backend(CPU, torch.bfloat16, 64) == "torch_sdpa"  # the C kernels are fp32
    assert auto_backend(torch.device("cuda"), torch.bfloat16, 128) == "triton_paged"
    assert auto_backend(torch.device("cuda"), torch.bfloat16, 72) == "torch_sdpa"  # not a multiple of 16


@pytest.mark.parametrize(("name", "device", "dtype", "head_dim", "error"), [
    ("flash", CPU, torch.float32, 64,
     "unknown attention backend 'flash' (have: auto, torch_sdpa, cpu_c, triton_paged)"),
    ("cpu_c", torch.device("cuda"), torch.float32, 64, "cpu_c cannot serve this model: device cuda"),
    ("cpu_c", CPU, torch.bfloat16, 64, "cpu_c cannot serve this model: dtype torch.bfloat16"),
    ("triton_paged", torch.device("cuda"), torch.float32, 72, "head_dim 72"),
])
def test_a_backend_that_cannot_serve_is_refused_in_one_line(name, device, dtype, head_dim, error):
    with pytest.raises(ValueError, match=re.escape(error)) as e:
        attention_backend(name, device, dtype, head_dim)
    assert "\n" not in str(e.value)


def test_triton_paged_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA, or TRITON_INTERPRET=1"):
        attention_backend("triton_paged", CPU, torch.float32, 64)


def test_engine_config_refuses_an_unknown_backend_name():
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch_sdpa, cpu_c, triton_paged"):
        EngineConfig(attention_backend="xformers")


def test_engine_refuses_weights_on_another_device():
    with pytest.raises(ValueError, match="configured for device cuda:1, but the weights are on cpu"):
        EngineCore(EngineConfig(model=MODEL, device="cuda:1", num_kv_blocks=16), loaded=_loaded(MODEL, "cpu"))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    cfg = _loaded(MODEL).config
    root = tmp_path_factory.mktemp("adapters")
    return [make_peft_dir(root / f"a{i}", cfg, rank=8, alpha=16, targets="all", seed=300 + i) for i in range(2)]


def _greedy(rid: str, ids, adapter: str | None, max_tokens: int = 12) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp, adapter=adapter)


def _run_mixed(backend: str, adapters) -> tuple[list[list[int]], EngineCore]:
    """Two waves: the second shares the first's prompts as prefixes (cache hits), its long prompt is
    prefilled in chunks of 32, and a repetitive prompt draws n-gram drafts."""
    core = make_core(attention_backend=backend, max_num_batched_tokens=32, speculative_tokens=3)
    for i, path in enumerate(adapters):
        core.add_adapter(f"a{i}", str(path))
    prompts = mixed_prompts(4, seed=11)
    names = ["a0", "a1", None, "a0"]
    first = core.run([_greedy(f"f{i}", p, a) for i, (p, a) in enumerate(zip(prompts, names, strict=True))])
    second = [p + [7, 8, 9] * (i + 1) for i, p in enumerate(prompts)] + [[5, 6] * 30]
    done = core.run([_greedy(f"s{i}", p, a) for i, (p, a) in enumerate(zip(second, names + ["a1"], strict=True))])
    return [c.token_ids for c in first + done], core


def test_greedy_tokens_identical_across_backends(adapters):
    """On the CPU: torch_sdpa, cpu_c and triton_paged (interpreted); on CUDA: torch_sdpa and triton_paged."""
    want, ref = _run_mixed("torch_sdpa", adapters)
    assert ref.runner.model.attention.name == "torch_sdpa"
    stats = ref.stats()
    assert stats.kv.prefix_hit_tokens > 0 and stats.speculation.draft_tokens > 0  # the batch held hits and drafts
    for name in ("cpu_c", "triton_paged") if on_cpu() else ("triton_paged",):
        got, core = _run_mixed(name, adapters)
        assert core.runner.model.attention is BACKENDS[name]
        assert got == want, name
        assert core.stats().kv.prefix_hit_tokens == stats.kv.prefix_hit_tokens
