"""The pieces of forced tool calls that need no server: the call's schema with each tool's `$ref`s
rebased under one root (checked by compiling it and matching calls), and the splitting of a call's
text into name and arguments however the stream cuts it."""

from __future__ import annotations

import json
import random

import pytest

from loraplex.platform.openai import schemas as s
from loraplex.platform.openai.tool_calls import CallText, call_schema
from tests.unit.test_guided_grammar import accepts

NODE = {"type": "object", "required": ["v", "next"],
        "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
PYDANTIC = {"$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
            "type": "object", "properties": {"home": {"$ref": "#/$defs/Address"},
                                             "work": {"$ref": "#/$defs/Address/properties/city"}},
            "required": ["home", "work"]}


def tool(name: str, parameters: dict | None) -> s.Tool:
    return s.Tool(type="function", function=s.FunctionDef(name=name, parameters=parameters))


def test_each_tools_refs_point_into_its_own_definitions():
    schema = call_schema([tool("walk", NODE), tool("mail", PYDANTIC), tool("ping", None)])
    assert accepts(schema, '{"name": "walk", "arguments": {"v": 1, "next": {"v": 2, "next": null}}}')
    assert accepts(schema, '{"name": "mail", "arguments": {"home": {"city": "Oslo"}, "work": "Bergen"}}')
    assert accepts(schema, '{"name": "ping", "arguments": {}}')
    assert not accepts(schema, '{"name": "ping", "arguments": {"x": 1}}')
    assert not accepts(schema, '{"name": "walk", "arguments": {"home": {"city": "Oslo"}, "work": "Bergen"}}')
    assert not accepts(schema, '{"name": "jump", "arguments": {}}')
    assert not accepts(schema, '{"arguments": {}, "name": "ping"}')  # the name comes first


TEXTS = [
    '{"name": "add", "arguments": {"a": 1, "b": {"c": [1, "}"]}}}',
    '\t{ \n"name"\n:  "get_weather" ,\r "arguments":\n\n  {"city": "Zo\\u00eb \\"Z\\"", "unit": "celsius"}\n  }',
    '{"name":"ping","arguments":{}}',
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_arguments_however_the_text_is_cut(text):
    value = json.loads(text)
    name, arguments = CallText.parse(text, complete=True)
    assert name == value["name"] and json.loads(arguments) == value["arguments"]
    assert arguments == arguments.strip()
    rng = random.Random(4)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 8)))
        call, names, pieces = CallText(), [], []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            named, piece = call.push(text[a:b])
            names += [named] if named else []
            pieces.append(piece)
            # nothing given out is ever taken back: what streamed is a prefix of the final arguments
            assert arguments.startswith("".join(pieces))
        pieces.append(call.finish(complete=True))
        assert names == [value["name"]] and "".join(pieces) == arguments


def test_a_call_cut_short_keeps_what_it_has():
    text = '{"name": "add", "arguments": {"a": 1, "b'
    assert CallText.parse(text, complete=False) == ("add", '{"a": 1, "b')
    assert CallText.parse('{"name": "ad', complete=False) == (None, "")
