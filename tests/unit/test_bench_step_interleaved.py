"""The lora bench's measurement: engines on one set of loaded weights taking turns step by step.

Each engine must produce exactly what it produces alone (they share the weights and the CPU decode
step's cached tables, keyed by each engine's own KV cache), and every generated token is counted."""

from __future__ import annotations

import pytest

from loraplex.cli.bench.engine import step_interleaved
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.models.loader import load_model, resolve_model

MODEL = "synthetic:tiny"


@pytest.fixture(scope="module")
def loaded():
    return load_model(resolve_model(MODEL))


def core_on(loaded) -> EngineCore:
    return EngineCore(EngineConfig(model=MODEL, device="cpu", dtype="float32", max_num_seqs=4), loaded=loaded)


def requests(tag: str, prompts: list[str], max_tokens: int) -> list[GenerateRequest]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [GenerateRequest(f"{tag}{i}", MODEL, prompt=p, sampling=sp) for i, p in enumerate(prompts)]


def test_engines_taking_turns_match_each_alone_and_count_every_token(loaded):
    prompts = {"a": ["hello there", "one two three four", "x"], "b": ["a different prompt", "zz"]}
    lengths = {"a": 6, "b": 9}  # b runs on after a has finished
    alone = {name: {c.request_id: c.token_ids for c in core_on(loaded).run(requests(name, p, lengths[name]))}
             for name, p in prompts.items()}
    cores = {name: core_on(loaded) for name in prompts}
    seen: dict[str, dict[str, list[int]]] = {name: {} for name in prompts}

    def collect(name, events):
        for ev in events:
            seen[name].setdefault(ev.request_id, []).extend(ev.token_ids)

    figures = step_interleaved(cores, {name: requests(name, p, lengths[name]) for name, p in prompts.items()},
                               on_events=collect)
    assert set(figures) == {"a", "b"} and all(v > 0 for v in figures.values())
    assert not any(core.has_work() for core in cores.values())
    for name in prompts:
        assert {rid: tuple(t) for rid, t in seen[name].items()} == {rid: tuple(t) for rid, t in alone[name].items()}
        assert all(len(t) == lengths[name] for t in seen[name].values())


def test_a_bad_request_is_refused_before_any_engine_starts(loaded):
    cores = {"a": core_on(loaded), "b": core_on(loaded)}
    bad = [GenerateRequest("x", MODEL, prompt="hi", sampling=SamplingParams(max_tokens=2), adapter="nope")]
    with pytest.raises(Exception, match="nope"):
        step_interleaved(cores, {"a": requests("a", ["fine"], 2), "b": bad})
    assert not any(core.has_work() for core in cores.values())
