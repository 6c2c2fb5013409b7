"""Forced tool calls (`tool_choice` "required" or a named function) through the tenant API, on
Postgres + Redis and on SQLite.

Why: the synthetic model's random weights would never call a tool by themselves, so every call that
comes back well-formed, naming a listed function with arguments that validate against its own
parameters (the `jsonschema` package checks), was held there by guided decoding. Streamed, the name and
the arguments' pieces must add up to the whole answer's call.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.integration.test_openai_api import _error, sse_events

UNIT = {"enum": ["celsius", "fahrenheit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"], "additionalProperties": False, "$defs": {"Unit": UNIT}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer"}}, "required": ["a", "b"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: {} is the only argument
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
              for t in (WEATHER, ADD, PING)}
MAX_TOKENS = 1200  # a string in the random model's output runs long before it draws a quote (context: 2048)
SAMPLINGS = [{"temperature": 1.0, "seed": seed} for seed in range(4)] + [{"temperature": 0}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _calls(api, key, tools, choice, **sampling):
    r = api.chat(key, "what now?", max_tokens=MAX_TOKENS, tools=tools, tool_choice=choice, **sampling)
    assert r.status_code == 200, r.text
    (c,) = r.json()["choices"]
    return c


def test_required_calls_name_a_tool_and_validate_against_its_parameters(api):
    key = api.key(api.tenant())
    finished = 0
    for sampling in SAMPLINGS:
        choice = _calls(api, key, [WEATHER, ADD, PING], "required", **sampling)
        if choice["finish_reason"] == "length":
            continue
        finished += 1
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])
    assert finished >= 3
    request = api.backend.engine.requests[-1]
    system = request.messages[0]
    assert system["role"] == "system" and '"get_weather"' in system["content"] and '"ping"' in system["content"]


@pytest.mark.parametrize("tool", [WEATHER, ADD, PING])
def test_a_named_function_is_the_one_called(api, tool):
    key = api.key(api.tenant())
    name = tool["function"]["name"]
    choice = _calls(api, key, [WEATHER, ADD, PING], named(name), temperature=1.0, seed=5)
    if choice["finish_reason"] == "tool_calls":
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == name
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])
    else:  # cut by max_tokens inside the arguments: the call so far, name included
        assert choice["finish_reason"] == "length"
        assert choice["message"]["tool_calls"][0]["function"]["name"] == name


def test_a_streamed_call_adds_up_to_the_whole_answer(api):
    key = api.key(api.tenant())
    whole = _calls(api, key, [WEATHER, ADD], named("add"), temperature=1.0, seed=2)
    r = api.chat(key, "what now?", max_tokens=MAX_TOKENS, tools=[WEATHER, ADD], tool_choice=named("add"),
                 temperature=1.0, seed=2, stream=True)
    chunks = sse_events(r.text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    first, *rest = deltas
    assert first["id"].startswith("call_") and first["function"]["name"] == "add" and first["type"] == "function"
    assert all("name" not in d["function"] and "id" not in d for d in rest)
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    assert arguments == whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


def test_earlier_calls_and_their_results_reach_the_model_as_text(api):
    key = api.key(api.tenant())
    messages = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "user", "content": "and the weather?"},
    ]
    r = api.post("/v1/chat/completions", key, {"model": "synthetic:tiny", "messages": messages, "max_tokens": 4,
                                               "tools": [WEATHER, ADD], "tool_choice": "none"})
    assert r.status_code == 200, r.text
    sent = api.backend.engine.requests[-1]
    assert sent.sampling.json_schema is None  # "none": a plain answer, and no tools prompt
    assert [m["role"] for m in sent.messages] == ["user", "assistant", "user", "user"]
    assert json.loads(sent.messages[1]["content"]) == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert sent.messages[2]["content"] == "Result of function call call_1:\n5"


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [ADD], "tool_choice": named("mul")}, "tool_choice", "'mul', which is not among the tools"),
    ({"tools": [ADD, ADD], "tool_choice": "required"}, "tools", "must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}, "tools", "'a b'"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"tools": [ADD], "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "'a b'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools", "invalid tool parameters: #/$defs/tool0/properties/s: `uniqueItems` is not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools with tool_choice"),
    ({"tools": [ADD], "tool_choice": "required", "stop": ["}"]}, "stop", "cannot be combined"),
])
def test_what_cannot_be_served_answers_400(api, fields, param, says):
    key = api.key(api.tenant())
    r = api.chat(key, **fields)
    code = "invalid_request" if "invalid tool parameters" in says else "invalid_value"
    _error(r, 400, code, param)
    assert says in r.json()["error"]["message"]


def _structured(api, kind: str) -> float:
    line = f'loraplex_structured_requests_total{{kind="{kind}"}} '
    found = [x for x in api.client.get("/metrics", headers=api.admin).text.splitlines() if x.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


def test_structured_requests_are_counted_by_kind_once_admitted(api):
    key = api.key(api.tenant())
    kinds = ("json_object", "json_schema", "tool_call")
    before = {k: _structured(api, k) for k in kinds}
    api.chat(key, max_tokens=4, response_format={"type": "json_object"})
    api.chat(key, max_tokens=4, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {}}})
    api.chat(key, max_tokens=4, tools=[ADD], tool_choice="required")
    api.chat(key, max_tokens=4, tools=[ADD], tool_choice="auto")  # free output: not counted
    api.chat(key, max_tokens=4, response_format={"type": "text"})  # free text: not counted
    assert {k: _structured(api, k) - before[k] for k in kinds} == dict.fromkeys(kinds, 1.0)
