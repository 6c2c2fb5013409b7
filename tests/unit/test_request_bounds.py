"""Engine-side bounds of request preparation: a prompt far too long for the context is refused before
it is templated or tokenized, and a logit_bias becomes tensors once, at prepare."""

from __future__ import annotations

import time

import pytest
import torch

from loraplex.engine.api import ContextLengthExceededError, GenerateRequest, SamplingParams
from loraplex.engine.frontend import CHARS_PER_TOKEN
from tests.conftest import make_core
from tests.unit.test_engine_core import MODEL


@pytest.mark.parametrize("shape", ["prompt", "messages", "parts"])
def test_a_multi_megabyte_prompt_is_refused_before_tokenizing(shape):
    core = make_core()
    huge = "lorem ipsum " * 800_000  # 9.6 MB
    kwargs = {"prompt": huge} if shape == "prompt" else {"messages": (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": huge if shape == "messages" else [{"type": "text", "text": huge}]})}
    t0 = time.monotonic()
    with pytest.raises(ContextLengthExceededError) as info:
        core.prepare(GenerateRequest("huge", MODEL, sampling=SamplingParams(max_tokens=4), **kwargs))
    assert time.monotonic() - t0 < 10  # refused without tokenizing (that took seconds)
    assert info.value.param == ("prompt" if shape == "prompt" else "messages")
    assert f"longer than {CHARS_PER_TOKEN * core.max_model_len} characters" in info.value.message
    assert not core.has_work()


def test_a_prompt_within_the_character_bound_is_measured_in_tokens():
    core = make_core(max_model_len=64)
    with pytest.raises(ContextLengthExceededError, match="tokens in the prompt|in the prompt"):
        core.prepare(GenerateRequest("long", MODEL, prompt="x" * (CHARS_PER_TOKEN * 64),
                                     sampling=SamplingParams(max_tokens=4)))
    (done,) = core.run([GenerateRequest("ok", MODEL, prompt="x" * 20, sampling=SamplingParams(max_tokens=4))])
    assert done.finish_reason in ("length", "stop")


def test_logit_bias_becomes_tensors_once_at_prepare():
    core = make_core()
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=1, logit_bias=((65, 100.0), (66, -100.0)))
    r = core.prepare(GenerateRequest("b", MODEL, prompt_token_ids=(1, 2, 3), sampling=sp))
    ids, values = r.bias
    assert ids.tolist() == [65, 66] and values.tolist() == [100.0, -100.0] and ids.dtype == torch.long
    core.add(r)
    while core.has_work():
        core.step()
        assert r.bias[0] is ids  # the same tensors every step
    assert r.output_ids == [65] * 6
    assert core.prepare(GenerateRequest("n", MODEL, prompt_token_ids=(1,), sampling=SamplingParams())).bias is None
