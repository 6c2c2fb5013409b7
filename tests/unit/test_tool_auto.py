"""`tool_choice: "auto"` without a server: which answers are calls, and the streamed chunks of both
kinds of answer however the text arrives."""

from __future__ import annotations

import json
import random

import pytest

from loraplex.platform.openai.tool_auto import AutoToolFormat, parse_calls

NAMES = frozenset({"add", "weather"})


@pytest.mark.parametrize(("text", "calls"), [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', [("add", '{"a": 1, "b": 2}')]),
    ('  \n{"name": "weather", "parameters": {"city": "Oslo"}}\n', [("weather", '{"city": "Oslo"}')]),
    ('```json\n{"name": "add", "arguments": {}}\n```', [("add", "{}")]),
    ('{"name": "weather"}', [("weather", "{}")]),
    ('[{"name": "add", "arguments": {"a": 1}}, {"name": "weather", "arguments": {"city": "Rome"}}]',
     [("add", '{"a": 1}'), ("weather", '{"city": "Rome"}')]),
    ('{"name": "mul", "arguments": {}}', None),  # not a listed tool
    ('{"name": "add", "arguments": [1, 2]}', None),  # arguments must be an object
    ('{"name": "add", "arguments": {}, "why": "x"}', None),  # more than a call
    ('{"name": "add", "arguments": {"a": 1}', None),  # cut short
    ('The answer is {"name": "add"}', None),
    ("[]", None),
    ("Just text.", None),
])
def test_an_answer_is_a_call_only_when_it_is_wholly_calls_of_listed_tools(text, calls):
    assert parse_calls(text, NAMES) == calls


def test_without_parallel_calls_a_list_of_several_is_text():
    two = '[{"name": "add", "arguments": {}}, {"name": "weather", "arguments": {}}]'
    assert parse_calls(two, NAMES, parallel=False) is None
    assert parse_calls('[{"name": "add", "arguments": {}}]', NAMES, parallel=False) == [("add", "{}")]


def _stream(text: str, cuts: list[int], finish: str = "stop") -> list[dict]:
    fmt = AutoToolFormat("abc", 0, "m", names=NAMES)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    raw = b"".join(filter(None, [fmt.first(), *(fmt.delta(p) for p in pieces), fmt.last(finish)]))
    return [json.loads(line[len("data: "):]) for line in raw.decode().split("\n\n") if line]


@pytest.mark.parametrize("seed", range(20))
def test_a_streamed_call_comes_whole_at_the_end_and_text_streams_at_once(seed):
    rng = random.Random(seed)
    call = '\n{"name": "add", "arguments": {"a": 1, "b": 22}}'
    cuts = sorted(rng.sample(range(1, len(call)), 4))
    chunks = _stream(call, cuts)
    assert all(not c["choices"][0]["delta"].get("content") for c in chunks)  # nothing of the call as text
    (calls,) = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert [(t["id"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == \
        [("call_abc", "add", {"a": 1, "b": 22})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    text = "  Sure, the sum is 23."
    chunks = _stream(text, sorted(rng.sample(range(1, len(text)), 4)))
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]]
    assert "".join(contents) == text and len(contents) >= 3  # streamed as it came, leading blanks included
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_held_answer_that_is_no_call_is_sent_as_text_at_the_end():
    text = '{"name": "add", "arguments": {"a": 1'  # cut by max_tokens
    chunks = _stream(text, [5, 20], finish="length")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_whole_answer_becomes_a_message_with_tool_calls_or_content():
    fmt = AutoToolFormat("abc", 0, "m", names=NAMES, index=1)
    call = fmt.choice('[{"name": "add", "arguments": {}}, {"name": "weather", "arguments": {"city": "Oslo"}}]',
                      (), "stop")
    assert call.index == 1 and call.finish_reason == "tool_calls" and call.message.content is None
    assert [(t.id, t.function.name) for t in call.message.tool_calls] == [("call_abc_1_0", "add"),
                                                                          ("call_abc_1_1", "weather")]
    text = fmt.choice("No call needed.", (), "stop")
    assert text.message.content == "No call needed." and text.finish_reason == "stop"
