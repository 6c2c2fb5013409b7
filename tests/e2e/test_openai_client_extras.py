"""Structured output, forced tool calls, log-probabilities and n choices from the real server
process, as OpenAI's own client asks for them and parses them.

Why: `client.chat.completions.parse(response_format=<pydantic model>)` sends the schema pydantic and
the client build (`$defs`/`$ref`, `additionalProperties: false`, `strict: true`) and validates the
answer into the model; this checks that such requests reach the engine intact and come back parseable
even from the synthetic model's random weights, and that a schema keyword the engine cannot enforce
is the client's BadRequestError naming it. The client's logprobs types must parse our bodies, chat
and legacy completions alike. The server and client fixtures are test_server_openai's.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.test_server_openai import demo, server  # noqa: F401 (fixtures: one server for this module)

MESSAGES = [{"role": "user", "content": "describe a person"}]


class Address(BaseModel):
    city: str
    zip_code: int


class Person(BaseModel):
    name: str
    age: int
    active: bool
    color: Literal["red", "green", "blue"]
    tags: list[str]
    address: Address
    rating: int = Field(ge=1, le=5)  # `minimum` / `maximum`: enforced, and pydantic checks them again
    code: str = Field(max_length=4)  # `maxLength` likewise


class Slug(BaseModel):
    name: str = Field(pattern=r"^[a-z]+$", max_length=12)  # pydantic emits `pattern`: the grammar enforces it


class Tags(BaseModel):
    tags: set[int]  # pydantic emits `uniqueItems`, which the grammar engine cannot enforce


def test_parse_returns_the_pydantic_model_whenever_the_answer_finishes(demo):  # noqa: F811
    parsed, cut = [], 0
    for seed in range(4):
        try:
            answer = demo.chat.completions.parse(model="synthetic:tiny", messages=MESSAGES, response_format=Person,
                                                 max_tokens=1500, temperature=1.0, seed=seed)
        except openai.LengthFinishReasonError as e:  # the client refuses to parse an answer max_tokens cut
            assert e.completion.usage.completion_tokens == 1500
            cut += 1
            continue
        (choice,) = answer.choices
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed
        parsed.append(choice.message.parsed)
    assert parsed and len(parsed) + cut == 4


def test_streamed_json_object_joins_into_one_object(demo):  # noqa: F811
    chunks = list(demo.chat.completions.create(
        model="synthetic:tiny", messages=[{"role": "user", "content": "json please"}], max_tokens=400,
        temperature=1.0, seed=1, stream=True, response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"  # with this seed the object closes well before 400
    assert isinstance(json.loads(text), dict)


def test_a_pattern_is_enforced(demo):  # noqa: F811
    chat = demo.chat.completions.parse(model="synthetic:tiny", messages=MESSAGES, response_format=Slug,
                                       max_tokens=50, temperature=1.0, seed=3)
    choice = chat.choices[0]
    assert choice.finish_reason == "stop", choice  # at most 12 letters and the closing bytes fit in 50 tokens
    assert re.fullmatch(r"[a-z]{1,12}", choice.message.parsed.name), choice.message.content


def test_a_schema_keyword_the_engine_cannot_enforce_is_a_bad_request(demo):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as info:
        demo.chat.completions.parse(model="synthetic:tiny", messages=MESSAGES, response_format=Tags, max_tokens=50)
    assert info.value.param == "response_format" and "`uniqueItems`" in info.value.message
    assert info.value.body["message"].startswith("invalid JSON schema: ")


def test_logprobs_parse_into_the_clients_types(demo):  # noqa: F811
    chat = demo.chat.completions.create(model="synthetic:tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                        logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and isinstance(t.bytes, list) for t in content)
    text = demo.completions.create(model="synthetic:tiny", prompt="abc", max_tokens=5, temperature=0, logprobs=1)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == text.usage.completion_tokens
    assert all(t in top for t, top in zip(lp.tokens, lp.top_logprobs, strict=True))


class Lookup(BaseModel):
    """Look a city up."""

    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


def test_a_forced_tool_call_parses_into_the_pydantic_arguments(demo):  # noqa: F811
    tools = [openai.pydantic_function_tool(Lookup), openai.pydantic_function_tool(Person)]
    answer = demo.chat.completions.parse(model="synthetic:tiny", messages=MESSAGES, tools=tools, max_tokens=400,
                                         tool_choice={"type": "function", "function": {"name": "Lookup"}},
                                         temperature=1.0, seed=2)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "Lookup" and isinstance(call.function.parsed_arguments, Lookup)
    assert 1 <= call.function.parsed_arguments.days <= 7


def test_echo_scores_a_prompt_as_evaluation_harnesses_ask(demo):  # noqa: F811
    """lm-eval's loglikelihood requests: echo, logprobs 1, one new token."""
    scored = demo.completions.create(model="synthetic:tiny", prompt="Paris is the capital of", echo=True,
                                     logprobs=1, max_tokens=1, temperature=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith("Paris is the capital of")
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:scored.usage.prompt_tokens])


def test_n_choices_parse_whole_and_streamed(demo):  # noqa: F811
    fields = {"model": "synthetic:tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 1.0, "seed": 9, "n": 3}
    whole = demo.chat.completions.create(**fields)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in demo.chat.completions.create(**fields, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert [texts[c.index] for c in whole.choices] == [c.message.content for c in whole.choices]
    assert finished == {c.index: c.finish_reason for c in whole.choices}
