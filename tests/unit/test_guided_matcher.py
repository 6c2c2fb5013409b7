"""The JSON Schema compiler and the byte matcher of guided decoding (engine/guided).

The matcher must accept every text a schema allows that it promises to produce (completeness, on
random documents), and nothing that json.loads or the independent `jsonschema` validator would refuse
(soundness, on random mutations of those documents).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from loraplex.engine.guided.guide import matcher_for
from loraplex.engine.guided.matcher import MAX_WS
from loraplex.engine.guided.schema import SchemaError, compile_schema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", 3]}, "minItems": 1, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
}
TREE = {
    "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "number"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}},
    "$ref": "#/$defs/node",
}


def matcher(schema):
    return matcher_for(compile_schema(json.dumps(schema)))


def final_state(schema, text: str | bytes):
    m = matcher(schema)
    return m, m.advance_bytes(m.start, text.encode() if isinstance(text, str) else text)


def accepts(schema, text: str | bytes) -> bool:
    m, state = final_state(schema, text)
    return state is not None and m.accepts(state)


@pytest.mark.parametrize("text", [
    '{}', '{"a": 1}', ' {"k" : "v"}', '{"a": [1, -0.5, 2.5e-3, 1E+9, "x\\u00e9\\n", true, false, null, {"b": {}}]}',
    '{"é": "ü😀"}', '{\n  "a": [\n    {}\n  ]\n}', '{"a":"\\"\\\\\\/\\b\\f\\r\\t"}',
])
def test_json_object_mode_accepts_json_objects(text):
    assert accepts({"type": "object"}, text)


@pytest.mark.parametrize("text", [
    '[1]', '"s"', '{"a":}', '{"a":01}', '{"a":1,}', '{,}', "{'a':1}", '{"a":"\x01"}', '{"a":"\\x"}',
    '{"a":"\\u12G4"}', '{"a":NaN}', '{"a":.5}', '{"a":1.}', '{"a":-}', '{} ', '{}{}', '{"a":tru}',
    b'{"a":"\xc3"}', b'{"a":"\x80"}', b'{"a":"\xff"}',
])
def test_json_object_mode_refuses_what_is_not_one_json_object(text):
    assert not accepts({"type": "object"}, text)


@pytest.mark.parametrize(("text", "ok"), [
    ('{"name":"x","age":3,"tags":["a"]}', True),
    ('{"name":"x","age":3,"email":null,"tags":["bb",3],"ok":false}', True),
    ('{"name":"x","age":3,"email":"e","tags":[3]}', True),
    ('{"name":"x","age":3,"tags":[]}', False),  # minItems
    ('{"name":"x","age":3,"tags":["a","a","a"]}', False),  # maxItems
    ('{"age":3,"name":"x","tags":["a"]}', False),  # declared order
    ('{"name":"x","tags":["a"]}', False),  # a required property skipped
    ('{"name":"x","age":3.5,"tags":["a"]}', False),  # integer
    ('{"name":"x","age":3,"tags":["c"]}', False),  # enum
    ('{"name":"x","age":3,"tags":["a"],"extra":1}', False),  # no undeclared keys
    ('{"name":"x","age":3,"tags":["a"],"ok":"yes"}', False),
])
def test_declared_properties_types_enums_and_array_bounds(text, ok):
    assert accepts(PERSON, text) is ok
    if ok:
        jsonschema.validate(json.loads(text), PERSON)


def test_refs_recurse_and_unions_keep_every_alternative_alive():
    assert accepts(TREE, '{"v":1,"kids":[{"v":2,"kids":[]},{"v":-3.5}]}')
    assert not accepts(TREE, '{"v":1,"kids":[{"w":2}]}')
    assert accepts({"anyOf": [{"type": "string"}, {"type": "null"}]}, "null")
    assert accepts({"type": ["integer", "string"]}, '"7"')
    assert accepts({"enum": [1, 12, "12"]}, "12") and accepts({"enum": [1, 12, "12"]}, '"12"')
    assert not accepts({"enum": [1, 12]}, "13")
    assert accepts({"const": {"a": [1, None]}}, '{"a":[1,null]}')
    assert accepts({"type": "object", "additionalProperties": {"type": "integer"}}, '{"x": 1, "y": 2}')
    assert not accepts({"type": "object", "additionalProperties": {"type": "integer"}}, '{"x": "1"}')
    assert accepts({"type": "object", "additionalProperties": False}, "{}")
    assert not accepts({"type": "object", "additionalProperties": False}, '{"x": 1}')


def test_terminal_states_end_the_output_and_root_numbers_may_grow():
    m, state = final_state(PERSON, '{"name":"x","age":3,"tags":["a"]}')
    assert m.terminal(state) and m.accepts(state)
    m, state = final_state({"type": "integer"}, "12")
    assert m.accepts(state) and not m.terminal(state)
    assert m.advance(state, ord("3")) is not None
    m, state = final_state(PERSON, '{"name":"x"')
    assert not m.accepts(state) and not m.terminal(state)


def test_whitespace_runs_are_capped():
    assert accepts({"type": "object"}, "{" + " " * MAX_WS + "}")
    assert not accepts({"type": "object"}, "{" + " " * (MAX_WS + 1) + "}")


def test_every_prefix_of_an_accepted_text_is_alive():
    text = '{"name":"Zoë \\"Z\\"","age":-12,"email":null,"tags":["bb",3],"ok":true}'.encode()
    m = matcher(PERSON)
    state = m.start
    for b in text:
        state = m.advance(state, b)
        assert state is not None
    assert m.terminal(state)


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["obj", "arr", "str", "int", "float", "lit"] if depth < 3 else ["str", "int", "float", "lit"])
    if kind == "obj":
        return {random_text(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == "arr":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "str":
        return random_text(rng)
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-30, 30)
    return rng.choice([True, False, None])


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice('ab "\\\n\t/é€😀\x01') for _ in range(rng.randint(0, 6)))


def dumps(rng: random.Random, value) -> str:
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1, 2]),
                      separators=rng.choice([None, (",", ":")]))


def test_random_objects_are_accepted_in_every_layout():
    rng = random.Random(7)
    for _ in range(300):
        value = {random_text(rng): random_value(rng) for _ in range(rng.randint(0, 4))}
        assert accepts({"type": "object"}, dumps(rng, value)), value


def _strict_loads(data: bytes):
    def refuse(name):
        raise ValueError(name)
    return json.loads(data.decode("utf-8"), parse_constant=refuse)


def test_mutations_the_matcher_accepts_are_valid_json_and_valid_for_the_schema():
    rng = random.Random(11)
    checked = 0
    for schema, make in [({"type": "object"}, lambda: {random_text(rng): random_value(rng) for _ in range(3)}),
                         (PERSON, lambda: {"name": random_text(rng), "age": rng.randint(-9, 99),
                                           "tags": rng.sample(["a", "bb", 3], rng.randint(1, 2))})]:
        for _ in range(200):
            data = bytearray(dumps(rng, make()).encode())
            for _ in range(rng.randint(1, 3)):  # delete, insert or replace a byte
                pos = rng.randrange(len(data) + 1)
                op = rng.choice("dir")
                byte = rng.choice(b'{}[]:,"\\ 0123456789.eE-+tfnul\xc3\xa9\x80')
                if op == "d" and pos < len(data):
                    del data[pos]
                elif op == "i":
                    data.insert(pos, byte)
                elif pos < len(data):
                    data[pos] = byte
            if accepts(schema, bytes(data)):
                checked += 1
                jsonschema.validate(_strict_loads(bytes(data)), schema)
    assert checked >= 20  # enough mutations survive for the check to mean something


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "string", "pattern": "a+"}, "`pattern` is not supported"),
    ({"type": "integer", "multipleOf": 5}, "`multipleOf` is not supported"),
    ({"type": "number", "minimum": 0}, "`minimum` is supported on integers only"),
    ({"minimum": 0}, "`minimum` needs a `type`"),
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 3}, "no integer lies within the bounds"),
    ({"type": "integer", "exclusiveMinimum": True}, "must be a finite number"),
    ({"type": "string", "minLength": 4, "maxLength": 2}, "maxLength 2 is below minLength 4"),
    ({"$ref": "#"}, "$ref loop"),
    ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ({"$ref": "http://example.com/s.json"}, "only references inside the schema"),
    (False, "allows no value"),
    ({"type": "text"}, "`type` must be one of"),
    ({"type": "object", "properties": {}, "required": ["x"]}, "'x' is required but not among the properties"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems 2 is below minItems 3"),
    ({"allOf": [{"type": "string"}, {"type": "null"}]}, "`allOf` is supported only"),
    ({"enum": []}, "non-empty list"),
    ({"properties": {"a": {"type": "array", "uniqueItems": True}}}, "#/properties/a: `uniqueItems`"),
])
def test_unsupported_or_broken_schemas_are_refused_naming_the_problem(schema, says):
    with pytest.raises(SchemaError, match=None) as info:
        compile_schema(json.dumps(schema))
    assert says in str(info.value)


def test_not_json_is_refused_and_annotations_are_ignored():
    with pytest.raises(SchemaError, match="not valid JSON"):
        compile_schema("{type: object}")
    schema = {"title": "T", "description": "d", "type": "string", "format": "date-time", "default": "x"}
    assert accepts(schema, '"anything"')


def test_a_schema_text_compiles_once():
    text = json.dumps(PERSON)
    assert compile_schema(text) is compile_schema(text)


def test_strings_hold_exactly_the_valid_utf8():
    rng = random.Random(5)
    m = matcher({"type": "string"})
    samples = [b"\xe0\xa0\x80", b"\xed\x9f\xbf", b"\xf0\x90\x80\x80", b"\xf4\x8f\xbf\xbf",  # edges that are valid
               b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\x80", b"\xf5\x80\x80\x80"]  # and not
    samples += [bytes(rng.choice(b"a\x80\x8f\x90\x9f\xa0\xbf\xc2\xdf\xe0\xe1\xed\xef\xf0\xf3\xf4")
                      for _ in range(rng.randint(1, 6))) for _ in range(3000)]
    for data in samples:
        try:
            data.decode("utf-8")
            valid = True
        except UnicodeDecodeError:
            valid = False
        state = m.advance_bytes(m.start, b'"' + data + b'"')
        assert (state is not None and m.accepts(state)) is valid, data


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "maxLength": 1},
    {"type": "string", "minLength": 3},
])
def test_string_lengths_count_characters_as_json_schema_does(schema):
    rng = random.Random(8)
    texts = ["", "a", "ab", "é€😀", "abcd", "abcde", "\n\t", "x\"y"]
    texts += ["".join(rng.choice("aé€😀\n\"\\") for _ in range(rng.randint(0, 6))) for _ in range(300)]
    for text in texts:
        valid = jsonschema.Draft202012Validator(schema).is_valid(text)
        for encoded in (json.dumps(text), json.dumps(text, ensure_ascii=False)):  # \u escapes are one character
            assert accepts(schema, encoded) is valid, (schema, encoded)


@pytest.mark.parametrize("bounds", [
    {"minimum": 0}, {"maximum": -3}, {"minimum": -12, "maximum": 7}, {"minimum": 5, "maximum": 105},
    {"exclusiveMinimum": 1.5, "exclusiveMaximum": 40}, {"minimum": -0.5, "maximum": 0.5}, {"minimum": 100},
])
def test_integer_bounds_accept_exactly_the_integers_in_range(bounds):
    schema = {"type": "integer", **bounds}
    validator = jsonschema.Draft202012Validator(schema)
    m = matcher(schema)
    for value in range(-200, 201):
        assert accepts(schema, str(value)) is validator.is_valid(value), (bounds, value)
    assert not accepts(schema, "1.5") and not accepts(schema, "01")
    # a prefix stays alive exactly while some integer in range still starts with it
    for prefix in ("-", "-1", "1", "10", "9"):
        state = m.advance_bytes(m.start, prefix.encode())
        reachable = any(str(v).startswith(prefix) and validator.is_valid(v) for v in range(-2000, 2001))
        assert (state is not None) is reachable, (bounds, prefix)


def test_bounded_integers_and_strings_inside_objects():
    schema = {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                               "tag": {"type": "string", "maxLength": 3}}, "required": ["stars", "tag"]}
    assert accepts(schema, '{"stars": 5, "tag": "abc"}')
    assert not accepts(schema, '{"stars": 6, "tag": "abc"}') and not accepts(schema, '{"stars": 0, "tag": "a"}')
    assert not accepts(schema, '{"stars": 3, "tag": "abcd"}')
    assert accepts({"type": ["integer", "null"], "maximum": 2}, "null")  # bounds bind the integer alternative only


@pytest.mark.parametrize(("escaped", "ok"), [
    ("\\ud83d\\ude00", True), ("\\uDBFF\\uDFFF", True), ("\\ud7ff", True), ("\\ue000", True),
    ("\\ud83d", False), ("\\ude00", False), ("\\ud83dx", False), ("\\ud83d\\u0041", False),
])
def test_escaped_surrogates_come_in_pairs(escaped, ok):
    assert accepts({"type": "string"}, f'"{escaped}"') is ok
    assert accepts({"type": "string", "maxLength": 1}, f'"{escaped}"') is ok  # a pair is one character
