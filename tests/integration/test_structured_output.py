"""Structured output (`response_format`) through the tenant API on Postgres + Redis and on SQLite.

Why these checks: the synthetic model's weights are random, so its free text is junk, and only guided
decoding stands between it and the client. Whatever the sampler draws, an answer that ends with
finish_reason "stop" must be JSON that an independent validator (`jsonschema`) accepts against the
schema asked for; one cut by max_tokens ("length") is a prefix of a root object, so never complete
JSON. `pattern`, `format` and number bounds are enforced. A schema the engine cannot enforce is
refused with a 400 naming it, before anything is queued, counted or rate-limited.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.integration.test_openai_api import _error, sse_events

SEEDS = range(5)
ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
           "required": ["city", "zip"], "additionalProperties": False}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "active": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "address": {"$ref": "#/$defs/address"},
    },
    "required": ["name", "age", "active", "color", "tags", "address"],
    "additionalProperties": False,
    "$defs": {"address": ADDRESS},
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
JSON_OBJECT = {"type": "json_object"}
# A string in the random model's output runs a few hundred bytes (tokens) before it draws a quote.
SCHEMA_MAX_TOKENS = 1500


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}


def _samplings() -> list[dict]:
    """Several seeds at temperature 1, and greedy (which may loop inside a string until max_tokens)."""
    return [{"temperature": 1.0, "seed": seed} for seed in SEEDS] + [{"temperature": 0}]


def _check(content: str, finish_reason: str, completion_tokens: int, max_tokens: int, schema: dict):
    """The value of a finished answer, validated; None for one cut at max_tokens (never whole JSON)."""
    if finish_reason == "length":
        assert completion_tokens == max_tokens
        with pytest.raises(ValueError):
            json.loads(content)
        return None
    assert finish_reason == "stop", finish_reason
    value = json.loads(content)
    jsonschema.validate(value, schema)
    return value


def test_json_object_answers_are_json_objects_on_both_endpoints(api):
    key = api.key(api.tenant())
    values = []
    for sampling in _samplings():
        chat = api.chat(key, "reply in JSON", max_tokens=400, response_format=JSON_OBJECT, **sampling)
        assert chat.status_code == 200, chat.text
        (choice,) = chat.json()["choices"]
        values.append(_check(choice["message"]["content"], choice["finish_reason"],
                             chat.json()["usage"]["completion_tokens"], 400, {"type": "object"}))
        text = api.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": "{", "max_tokens": 400,
                                                  "response_format": JSON_OBJECT, **sampling})
        assert text.status_code == 200, text.text
        (choice,) = text.json()["choices"]
        values.append(_check(choice["text"], choice["finish_reason"], text.json()["usage"]["completion_tokens"],
                             400, {"type": "object"}))
    finished = [v for v in values if v is not None]
    assert len(finished) >= len(values) // 2
    assert all(isinstance(v, dict) for v in finished)


def test_json_schema_answers_validate_against_the_schema(api):
    key = api.key(api.tenant())
    values = []
    for sampling in _samplings():
        r = api.chat(key, "describe a person", max_tokens=SCHEMA_MAX_TOKENS, response_format=PERSON_FORMAT,
                     **sampling)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        values.append(_check(choice["message"]["content"], choice["finish_reason"],
                             r.json()["usage"]["completion_tokens"], SCHEMA_MAX_TOKENS, PERSON))
    finished = [v for v in values if v is not None]
    assert len(finished) >= 2, values
    assert all(list(v) == list(PERSON["properties"]) for v in finished)  # the declared order
    assert json.loads(api.backend.engine.requests[-1].sampling.json_schema) == PERSON  # reached it whole


CODED = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "day": {"type": "string", "format": "date"},
    "score": {"type": "number", "minimum": 0, "maximum": 1}, "n": {"type": "integer", "multipleOf": 7}},
    "required": ["code", "day", "score", "n"]}


def test_pattern_format_and_number_bounds_are_enforced(api):
    key = api.key(api.tenant())
    fmt = {"type": "json_schema", "json_schema": {"name": "coded", "schema": CODED}}
    finished = 0
    for sampling in _samplings():
        r = api.chat(key, "a code", max_tokens=400, response_format=fmt, **sampling)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        value = _check(choice["message"]["content"], choice["finish_reason"], r.json()["usage"]["completion_tokens"],
                       400, CODED)
        if value is not None:
            finished += 1
            jsonschema.validate(value, CODED, format_checker=jsonschema.FormatChecker())
    assert finished >= 2


def test_stream_gives_the_same_json_as_the_whole_answer(api):
    key = api.key(api.tenant())
    body = {"max_tokens": SCHEMA_MAX_TOKENS, "response_format": PERSON_FORMAT, "temperature": 1.0, "seed": 10}
    plain = api.chat(key, "stream a person", **body).json()
    r = api.chat(key, "stream a person", stream=True, stream_options={"include_usage": True}, **body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *content, last, usage_chunk = sse_events(r.text)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in [*content, last])
    assert text == plain["choices"][0]["message"]["content"]
    assert last["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    jsonschema.validate(json.loads(text), PERSON)


def test_type_text_is_the_same_as_no_response_format(api):
    key = api.key(api.tenant())
    free = api.chat(key, "anything", max_tokens=24)
    text = api.chat(key, "anything", max_tokens=24, response_format={"type": "text"})
    assert text.status_code == 200, text.text
    assert api.backend.engine.requests[-1].sampling.json_schema is None
    assert text.json()["choices"] == free.json()["choices"]


@pytest.mark.parametrize(("fields", "code", "param", "named"), [
    ({"response_format": _schema_format({"type": "array", "uniqueItems": True})},
     "invalid_request", "response_format", "`uniqueItems`"),
    ({"response_format": _schema_format({"type": "object", "properties": {"n": {"not": {"const": 2}}}})},
     "invalid_request", "response_format", "#/properties/n: `not`"),
    ({"response_format": _schema_format({"$ref": "#/$defs/missing"})}, "invalid_request", "response_format",
     "does not exist"),
    ({"response_format": {"type": "json_schema"}}, "invalid_value", "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "invalid_value", "response_format.type", "yaml"),
    ({"response_format": JSON_OBJECT, "ignore_eos": True}, "invalid_request", "ignore_eos", "ignore_eos"),
])
def test_bad_response_formats_answer_400_naming_the_problem(api, fields, code, param, named):
    key = api.key(api.tenant())
    err = _error(api.chat(key, **fields), 400, code, param)
    assert named in err["message"] and err["type"] == "invalid_request_error"
    completion = api.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": "x", **fields})
    assert _error(completion, 400, code, param)["message"] == err["message"]


def test_a_refused_schema_costs_no_usage_and_no_rate_limit(api):
    key = api.key(api.tenant(), rpm_limit=1)
    refused = [api.chat(key, response_format=_schema_format({"type": "array", "uniqueItems": True}))
               for _ in range(3)]
    assert all(r.status_code == 400 for r in refused)
    assert all("`uniqueItems`" in r.json()["error"]["message"] for r in refused)
    ok = api.chat(key, max_tokens=400, response_format=JSON_OBJECT)
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    ids = {r.headers["x-request-id"] for r in refused}
    assert all(e.request_id not in ids for e in api.usage.events)
    assert any(e.request_id == ok.headers["x-request-id"] for e in api.usage.events)
