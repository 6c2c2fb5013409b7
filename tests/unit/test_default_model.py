"""The real default model (SmolLM2-135M-Instruct GGUF) against HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from loraplex.cli.bench.engine import hf_model
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.attention.torch_sdpa import build_metadata
from loraplex.engine.kv.block_pool import allocate_kv_tensors
from loraplex.engine.models.llama import LlamaModel
from tests.conftest import make_core

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a screw press adapted from wine making. "
    "Within a few decades printing shops had spread to more than two hundred cities across Europe, "
    "and the cost of books fell so far that ordinary merchants could own them. Scholars argue "
    "that this flood of cheap text changed how people learned, argued and prayed: pamphlets carried "
    "the Reformation, newspapers carried trade prices, and scientists could finally compare"
)


@pytest.fixture(scope="module")
def hf(default_model):
    return hf_model(default_model)


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    ids = default_model.tokenizer.encode(PROMPT)
    assert 80 <= len(ids) <= 120
    return ids


def test_logits_match_transformers(default_model, hf, prompt_ids):
    model = LlamaModel(default_model.config, default_model.weights)
    cfg = default_model.config
    n = len(prompt_ids)
    kv = allocate_kv_tensors(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                             torch.device("cpu"))
    blocks = [3, 0, 7, 5, 1, 6, 2, 4]  # scattered on purpose
    with torch.inference_mode():
        ours = model.forward(torch.tensor(prompt_ids), torch.arange(n), build_metadata([(0, n, blocks)], 16, "cpu"),
                             kv, torch.arange(n))
        ref = hf(torch.tensor([prompt_ids])).logits[0].float()
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, rel


def test_greedy_32_tokens_identical_to_transformers(default_model, hf, prompt_ids):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          pad_token_id=0)
    want = out[0, len(prompt_ids):].tolist()
    core = make_core(MODEL)
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    (done,) = core.run([GenerateRequest("g", MODEL, prompt_token_ids=tuple(prompt_ids), sampling=sp)])
    assert done.token_ids == want


def test_batch_of_16_equals_alone_on_the_real_model(default_model):
    prompts = [f"Question {i}: " + "tell me about the sea and the sky. " * (1 + i % 5) for i in range(16)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(f"r{i}", MODEL, prompt=p, sampling=sp) for i, p in enumerate(prompts)]
    core = make_core(MODEL)
    alone = [core.run([r])[0].token_ids for r in reqs]
    batched = make_core(MODEL).run(reqs)
    assert [c.token_ids for c in batched] == alone


def test_chat_answer_is_text_and_stops(default_model):
    core = make_core(MODEL)
    sp = SamplingParams(max_tokens=48, temperature=0.0)
    req = GenerateRequest("c", MODEL, messages=({"role": "user", "content": "What is the capital of France?"},),
                          sampling=sp)
    (done,) = core.run([req])
    assert "Paris" in done.text
    assert "<|im_end|>" not in done.text
