"""Guided decoding inside the engine: every finished output of a schema request validates (even from a
random-weight model, whose free text is noise), the mask touches only its own request's row, and
preemption, seeds and bad schemas behave as for any other request. Engines and logits on the test device
(--device)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from loraplex.engine.api import EngineUnavailableError, GenerateRequest, InvalidRequestError, SamplingParams
from loraplex.engine.guided import grammar as grammar_module
from loraplex.engine.guided.masks import apply_masks
from tests.conftest import make_core, test_device
from tests.unit.test_engine_core import MODEL, mixed_prompts
from tests.unit.test_guided_grammar import PERSON, TREE, nested

SCHEMAS = [{"type": "object"}, PERSON, TREE, {"type": "array", "items": {"enum": ["x", 2, None]}, "maxItems": 4},
           {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3},
                                                 {"type": "integer", "minimum": -5, "maximum": 250}]}, "maxItems": 6}]


def request(rid: str, ids, schema=None, temperature=1.0, seed=None, max_tokens=160) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                        json_schema=None if schema is None else json.dumps(schema))
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp)


def guided_batch(prompts) -> list[GenerateRequest]:
    return [request(f"g{i}", prompts[i % len(prompts)], SCHEMAS[i % len(SCHEMAS)], temperature=(i % 3) * 0.6, seed=i)
            for i in range(12)]


def test_every_finished_output_validates_and_the_rest_ran_to_max_tokens():
    prompts = mixed_prompts(4, seed=2)
    done = make_core().run(guided_batch(prompts))
    stopped = [c for c in done if c.finish_reason == "stop"]
    assert len(stopped) >= 4  # enough closed values for the validation below to mean something
    for c, r in zip(done, guided_batch(prompts), strict=True):
        schema = json.loads(r.sampling.json_schema)
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
            assert c.token_ids[-1] != 256  # ended when the value closed, not by sampling end-of-sequence
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 160


def test_the_mask_touches_only_its_own_row():
    prompts = mixed_prompts(6, seed=5)
    plain = [request(f"p{i}", p, temperature=0.0, max_tokens=24) for i, p in enumerate(prompts)]
    alone = make_core().run(plain)
    guided = guided_batch(prompts)
    mixed = make_core().run(plain + guided)
    assert [c.token_ids for c in mixed[:len(plain)]] == [c.token_ids for c in alone]
    # and a guided request's tokens do not depend on its neighbours (seeded or greedy)
    assert [c.token_ids for c in mixed[len(plain):]] == [c.token_ids for c in make_core().run(guided)]


def test_greedy_rows_checking_their_best_token_pick_what_their_full_masks_pick(monkeypatch):
    """Where no core is spare, a greedy guided row checks its unmasked best token and fills its mask
    only if the schema refuses it; with the masks filled ahead for every row, the same tokens come."""
    from loraplex.engine.guided import masks

    prompts = mixed_prompts(5, seed=9)
    greedy = [request(f"g{i}", p, SCHEMAS[i], temperature=0.0, max_tokens=48) for i, p in enumerate(prompts)]
    monkeypatch.setattr(masks, "spare_cores", lambda: 0)
    checked = make_core().run(greedy)
    monkeypatch.setattr(masks, "spare_cores", lambda: 1)
    filled = make_core().run(greedy)
    assert [c.token_ids for c in checked] == [c.token_ids for c in filled]
    assert all(c.finish_reason in ("stop", "length") for c in checked)
    assert any(c.finish_reason == "stop" for c in checked)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_guided_requests_resume_where_they_were(mode):
    prompts = mixed_prompts(6, seed=4)
    reqs = [request(f"r{i}", p, PERSON if i % 2 else {"type": "object"}, temperature=0.0, max_tokens=40)
            for i, p in enumerate(prompts)]
    roomy = make_core(enable_prefix_caching=False).run(reqs)
    tight = make_core(num_kv_blocks=14, preemption_mode=mode)
    got = tight.run(reqs)
    assert sum(tight.stats().requests.preemptions_by_class.values()) > 0
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in roomy]
    assert tight.stats().kv.blocks_used == 0


def test_bad_schemas_are_refused_before_anything_is_queued():
    core = make_core()
    free = core.pool.num_free
    with pytest.raises(InvalidRequestError, match="`uniqueItems` is not supported") as info:
        core.add_request(request("bad", [1, 2, 3], {"type": "array", "uniqueItems": True}))
    assert info.value.param == "response_format"
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        core.add_request(GenerateRequest("bad2", MODEL, prompt_token_ids=(1, 2),
                                         sampling=SamplingParams(json_schema="{nope")))
    with pytest.raises(InvalidRequestError, match="ignore_eos cannot be combined") as info:
        core.add_request(GenerateRequest("bad3", MODEL, prompt_token_ids=(1, 2),
                                         sampling=SamplingParams(json_schema="{}", ignore_eos=True)))
    assert info.value.param == "ignore_eos"
    assert not core.requests and not core.has_work() and core.pool.num_free == free


def test_a_token_outside_the_mask_ends_only_that_request_with_an_error():
    """Masked logits leave the sampler no way out of the schema, but a token from outside it (a
    future sampler's bug) must end that request with an error event, not raise inside the step."""
    core = make_core(num_kv_blocks=64)
    core.add_request(request("bad", [1, 2, 3], {"type": "object"}, temperature=0.0))
    core.add_request(request("ok", [4, 5, 6], {"type": "object"}, temperature=0.0, max_tokens=8))
    core.step()  # both prefill and take their first token, "{"
    event = core._append(core.requests["bad"], ord("]"))
    assert event.finish_reason == "error" and "outside the JSON schema's mask" in event.error
    assert "bad" not in core.requests and "ok" in core.requests
    endings = []
    while core.has_work():  # the other request goes on to its own end
        endings += [ev.finish_reason for ev in core.step() if ev.finished]
    assert endings in (["stop"], ["length"])
    assert core.pool.num_used == 0


@pytest.mark.slow
def test_default_model_fills_a_schema_from_a_chat_prompt():
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["name", "age", "hobbies"]}
    core = make_core("smollm2-135m")
    msgs = ({"role": "user", "content": "Describe a person named Ann as JSON with name, age and hobbies."},)
    sp = SamplingParams(max_tokens=120, temperature=0.0, json_schema=json.dumps(schema))
    (done,) = core.run([GenerateRequest("ann", "smollm2-135m", messages=msgs, sampling=sp)])
    assert done.finish_reason == "stop"
    value = json.loads(done.text)
    jsonschema.validate(value, schema)
    assert value["name"] == "Ann"  # the model read the prompt: the mask chose the shape, not the words


def test_the_vocabulary_index_is_built_at_registration_and_shared_by_a_models_frontends():
    """The first request with a schema must not build the index on the caller's thread (the platform's
    event loop): registering the model builds it, once per tokenizer."""
    from loraplex.engine.guided import tokenizer
    from loraplex.engine.pool import ModelPool
    from tests.unit.test_model_pool import make_pool

    pool = make_pool()
    for entry in pool.models.values():
        assert entry.frontend.tokenizer in tokenizer._BY_TOKENIZER
    core = make_core()
    adopted = ModelPool(memory_budget=1 << 30, device=str(test_device())).adopt(core)
    assert adopted.frontend.guide_vocabulary() is core.frontend.guide_vocabulary()
    pool.shutdown()


HOSTILE = ('{"$defs":{"x":{"anyOf":[{"type":"array","minItems":1,"items":{"$ref":"#/$defs/x"}},'
           '{"type":"array","minItems":1,"items":{"$ref":"#/$defs/x"}}]}},"$ref":"#/$defs/x"}')


def plain(rid: str, ids, max_tokens: int) -> GenerateRequest:
    """A request without a schema that runs to max_tokens."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, MODEL, prompt_token_ids=tuple(ids), sampling=sp)


def run_until_done(core, ids: set[str], limit_s: float = 30.0) -> dict[str, object]:
    """Steps until every id in `ids` has finished; their last events by id."""
    done: dict[str, object] = {}
    deadline = time.monotonic() + limit_s
    while ids - done.keys():
        assert time.monotonic() < deadline, f"still running: {ids - done.keys()}"
        done.update({ev.request_id: ev for ev in core.step() if ev.finished})
    return done


def test_the_recursive_alternatives_schema_runs_alone_beside_a_normal_request():
    core = make_core()
    hostile = GenerateRequest("hostile", MODEL, prompt_token_ids=(1, 2, 3), sampling=SamplingParams(
        max_tokens=64, temperature=0.0, json_schema=HOSTILE, logit_bias=((ord("["), 100.0),)))  # nests every token
    core.add_request(hostile)
    core.add_request(plain("normal", [4, 5, 6], 64))
    done = run_until_done(core, {"hostile", "normal"})
    assert done["normal"].finish_reason == "length" and done["normal"].usage.completion_tokens == 64
    assert done["hostile"].finish_reason in ("length", "error")
    assert core.pool.num_used == 0 and not core.requests


@pytest.mark.parametrize(("schema_text", "says"), [
    (json.dumps({"enum": [f"value {i}" for i in range(300_000)]}), "the limit is 65536 bytes"),
    (json.dumps(nested(300)), "deeper than 100 levels"),
    ("[" * 60_000 + "]" * 60_000, "the limit is 65536 bytes"),
])
def test_hostile_schemas_are_refused_at_prepare_and_the_engine_serves_on(schema_text, says):
    core = make_core()
    sp = SamplingParams(max_tokens=8, json_schema=schema_text)
    with pytest.raises(InvalidRequestError) as info:
        core.add_request(GenerateRequest("bad", MODEL, prompt_token_ids=(1, 2), sampling=sp))
    assert info.value.param == "response_format" and says in info.value.message
    (ok,) = core.run([request("ok", [1, 2], {"type": "object"}, temperature=0.0, max_tokens=8)])
    assert ok.finish_reason in ("stop", "length")


def test_a_mask_that_runs_out_of_fuel_ends_only_its_request_with_an_error():
    core = make_core(guided_step_max_items=20)  # enough to start an object, not to go far inside one
    core.add_request(request("guided", [1, 2, 3], {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "object"}}}}, temperature=0.0, max_tokens=64))
    core.add_request(plain("normal", [4, 5, 6], 32))
    done = run_until_done(core, {"guided", "normal"})
    assert done["guided"].finish_reason == "error" and "Too many items" in done["guided"].error
    assert done["normal"].finish_reason == "length" and done["normal"].usage.completion_tokens == 32
    assert core.pool.num_used == 0


def test_a_mask_not_ready_within_the_step_limit_fails_that_guide_alone(device):
    core = make_core(guided_mask_timeout_s=0.05)
    slow, fast = core.frontend.guide('{"type": "object"}'), core.frontend.guide('{"type": "object"}')
    busy = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as stuck:
        stuck.submit(busy.wait, 10)  # the only worker is busy: the mask waits in the queue
        slow.start_mask(stuck)
        fast.start_mask(ThreadPoolExecutor(max_workers=1))
        logits = torch.zeros(2, core.frontend.vocab_size, device=device)
        apply_masks(logits, [(0, slow), (1, fast)])
        busy.set()
    assert "took longer than 50 ms" in slow.error and fast.error is None
    assert torch.isfinite(logits[0]).all()  # left alone: the core ends that request
    assert torch.isfinite(logits[1]).sum() == 1 and torch.isfinite(logits[1, ord("{")])


def test_preparing_the_same_schema_again_reuses_the_compiled_grammar():
    core = make_core()
    reqs = [request(f"n{i}", [1, 2], PERSON, temperature=0.0) for i in range(3)]
    first, *again = [core.prepare(r) for r in reqs]
    assert len(core.frontend.grammars._entries) == 1
    assert all(r.guide.matcher is not first.guide.matcher for r in again)  # each its own copy
    assert first.guide.accept(ord("{")) and not again[0].guide.accept(ord("}"))


def test_a_mask_filled_on_the_engine_thread_past_the_limit_fails_that_guide_alone():
    """Where no core is spare the sampler fills the mask itself; one slower than the limit fails the same way."""
    core = make_core(guided_mask_timeout_s=1e-9)  # no fill is that fast
    guide = core.frontend.guide('{"type": "object"}')
    assert guide.mask() is None and "took longer than" in guide.error
    assert make_core().frontend.guide('{"type": "object"}').mask() is not None


def test_a_schema_that_finds_no_free_compiler_is_a_503_not_a_bad_schema():
    core = make_core(guided_compile_timeout_s=0.2)
    pool, release = grammar_module._COMPILE_POOL, threading.Event()
    held = [pool.submit(None, release.wait, 60) for _ in range(pool.workers)]
    try:
        with pytest.raises(EngineUnavailableError, match="waited 0.2 s for a compiler"):
            core.frontend.guide('{"type": "object", "properties": {"busy": {"type": "integer"}}}')
    finally:
        release.set()
        for job in held:
            job.result()
    assert core.frontend.guide('{"type": "object", "properties": {"busy": {"type": "integer"}}}') is not None
