"""Adapters made by HF PEFT on the real default model: our engine's greedy tokens equal PEFT's."""

from __future__ import annotations

import pytest
import torch

from loraplex.cli.bench.engine import hf_model
from loraplex.engine.api import GenerateRequest, SamplingParams
from tests.conftest import make_core

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# Per-module ranks and alphas, keys in sorted order (as PEFT saves them, so its model and the file agree).
PATTERNS = {"rank_pattern": {r"layers\.(1|2)?[0-9]\.mlp\.down_proj": 24, "q_proj": 4},
            "alpha_pattern": {"gate_proj": 4, "v_proj": 40}}


def _peft_adapter(base, path, rank: int, seed: int, use_rslora: bool = False, patterns: dict | None = None):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                             use_rslora=use_rslora, lora_dropout=0.0, **(patterns or {})))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.04)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize(("rank", "use_rslora", "patterns"), [(8, False, None), (16, True, None), (8, False, PATTERNS)],
                         ids=["r8", "r16-rslora", "r8-rank-and-alpha-patterns"])
def test_peft_adapter_greedy_tokens_match_peft(default_model, tmp_path, rank, use_rslora, patterns):
    peft_model = _peft_adapter(hf_model(default_model), tmp_path / "adapter", rank, seed=rank, use_rslora=use_rslora,
                               patterns=patterns)
    prompt = default_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then it")
    with torch.inference_mode():
        out = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    core = make_core(MODEL)
    core.add_adapter("peft", str(tmp_path / "adapter"))
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got, base = core.run([
        GenerateRequest("a", MODEL, prompt_token_ids=tuple(prompt), sampling=sp, adapter="peft"),
        GenerateRequest("b", MODEL, prompt_token_ids=tuple(prompt), sampling=sp),
    ])
    assert got.token_ids == want
    assert base.token_ids != want  # the adapter matters
