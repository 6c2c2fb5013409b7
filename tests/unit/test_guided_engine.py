"""Guided decoding inside the engine: every finished output of a schema request validates (even from a
random-weight model, whose free text is noise), the mask touches only its own request's row, and
preemption, seeds and bad schemas behave as for any other request."""

from __future__ import annotations

import json

import jsonschema
import pytest

from loraplex.engine.api import GenerateRequest, InvalidRequestError, SamplingParams
from tests.conftest import make_core
from tests.unit.test_engine_core import MODEL, mixed_prompts
from tests.unit.test_guided_matcher import PERSON, TREE

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


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_guided_requests_resume_where_they_were(mode):
    prompts = mixed_prompts(6, seed=4)
    reqs = [request(f"r{i}", p, PERSON if i % 2 else {"type": "object"}, temperature=0.0, max_tokens=40)
            for i, p in enumerate(prompts)]
    roomy = make_core(enable_prefix_caching=False).run(reqs)
    tight = make_core(num_kv_blocks=14, preemption_mode=mode)
    got = tight.run(reqs)
    assert sum(tight.stats().preemptions_by_class.values()) > 0
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in roomy]
    assert tight.stats().kv_blocks_used == 0


def test_bad_schemas_are_refused_before_anything_is_queued():
    core = make_core()
    free = core.pool.num_free
    with pytest.raises(InvalidRequestError, match="`pattern` is not supported") as info:
        core.add_request(request("bad", [1, 2, 3], {"type": "string", "pattern": "x"}))
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
    from loraplex.engine.guided import vocab
    from loraplex.engine.pool import ModelPool
    from tests.unit.test_model_pool import make_pool

    pool = make_pool()
    for entry in pool.models.values():
        assert entry.frontend.tokenizer in vocab._BY_TOKENIZER
    core = make_core()
    adopted = ModelPool(memory_budget=1 << 30, device="cpu").adopt(core)
    assert adopted.frontend.guide_vocabulary() is core.frontend.guide_vocabulary()
    pool.shutdown()
