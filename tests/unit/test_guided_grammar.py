"""Schemas compiled for guided decoding (engine/guided/grammar.py, llguidance underneath).

What the engine relies on: every text the matcher accepts is valid JSON that the independent
`jsonschema` validator accepts (soundness, on random mutations), every JSON object is accepted in any
layout (completeness in JSON mode), `pattern`, `format` and number bounds are enforced, what cannot be
enforced is refused naming the keyword, and hostile schemas are refused by the limits, never by a
RecursionError or a long wait. Matchers here run over the synthetic byte-level tokenizer (id = byte).
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from loraplex.engine.guided import grammar as grammar_module
from loraplex.engine.guided.grammar import (
    MAX_WS,
    CompileBusy,
    GrammarCache,
    GuideLimits,
    SchemaError,
    _Pending,
    check_schema,
)
from loraplex.engine.guided.tokenizer import guide_tokenizer
from loraplex.engine.models.tokenizer import Tokenizer

BYTES = Tokenizer.byte_level(512)
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
    "additionalProperties": False,
}
TREE = {
    "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "number"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}},
    "$ref": "#/$defs/node",
}


def grammars(**limits) -> GrammarCache:
    return GrammarCache(lambda: guide_tokenizer(BYTES, 512), dataclasses.replace(GuideLimits.from_config(), **limits))


_GRAMMARS = grammars()


def matcher(schema):
    return _GRAMMARS.matcher(schema if isinstance(schema, str) else json.dumps(schema))


def accepts(schema, text: str | bytes) -> bool:
    """The whole text is one value the schema allows (byte tokens: id = byte)."""
    m = matcher(schema)
    data = text.encode() if isinstance(text, str) else text
    return m.consume_tokens(list(data)) and m.is_accepting()


@pytest.mark.parametrize("text", [
    '{}', '{"a": 1}', '{"k" : "v"}', '{"a": [1, -0.5, 2.5e-3, 1E+9, "x\\u00e9\\n", true, false, null, {"b": {}}]}',
    '{"é": "ü😀"}', '{\n  "a": [\n    {}\n  ]\n}', '{"a":"\\"\\\\\\b\\f\\r\\t/"}', "{" + " " * MAX_WS + "}",
])
def test_json_object_mode_accepts_json_objects(text):
    assert accepts({"type": "object"}, text)


@pytest.mark.parametrize("text", [
    '[1]', '"s"', '{"a":}', '{"a":01}', '{"a":1,}', '{,}', "{'a':1}", '{"a":"\x01"}', '{"a":"\\x"}',
    '{"a":"\\u12G4"}', '{"a":NaN}', '{"a":.5}', '{"a":1.}', '{"a":-}', '{} ', '{}{}', '{"a":tru}',
    b'{"a":"\xc3"}', b'{"a":"\x80"}', b'{"a":"\xff"}', "{" + " " * (MAX_WS + 1) + "}",
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
    ('{"name":"x","age":3,"tags":["a"],"extra":1}', False),  # additionalProperties false
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
    assert not accepts({"type": "object", "additionalProperties": False}, '{"x": 1}')


def test_a_closed_value_stops_the_matcher_and_root_numbers_may_grow():
    m = matcher(PERSON)
    assert m.consume_tokens(list(b'{"name":"x","age":3,"tags":["a"]}'))
    assert m.is_stopped() and m.is_accepting()
    m = matcher({"type": "integer"})
    assert m.consume_tokens(list(b"12")) and m.is_accepting() and not m.is_stopped()
    assert m.consume_token(ord("3"))


def test_pattern_format_and_number_bounds_are_enforced():
    assert accepts({"type": "string", "pattern": "^a+$"}, '"aaa"')
    assert not accepts({"type": "string", "pattern": "^a+$"}, '"ab"')
    assert accepts({"type": "string", "format": "date"}, '"2024-02-29"')
    assert not accepts({"type": "string", "format": "date"}, '"yesterday"')
    assert accepts({"type": "number", "minimum": 1.5}, "1.6") and not accepts({"type": "number", "minimum": 1.5}, "1.4")
    fives = {"type": "integer", "multipleOf": 5}
    assert accepts(fives, "15") and not accepts(fives, "16")
    for value in range(-30, 31):
        schema = {"type": "integer", "minimum": -12, "exclusiveMaximum": 7}
        assert accepts(schema, str(value)) is jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 2, "maxLength": 4}, {"type": "string", "maxLength": 1}])
def test_string_lengths_count_characters_as_json_schema_does(schema):
    rng = random.Random(8)
    texts = ["", "a", "ab", "é€😀", "abcd", "abcde", "\n\t", "x\"y"]
    texts += ["".join(rng.choice("aé€😀\n\"\\") for _ in range(rng.randint(0, 6))) for _ in range(100)]
    for text in texts:
        valid = jsonschema.Draft202012Validator(schema).is_valid(text)
        assert accepts(schema, json.dumps(text, ensure_ascii=False)) is valid, (schema, text)


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
    for _ in range(200):
        value = {random_text(rng): random_value(rng) for _ in range(rng.randint(0, 4))}
        assert accepts({"type": "object"}, dumps(rng, value)), value


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
                value = json.loads(bytes(data).decode("utf-8"), parse_constant=lambda name: 1 / 0)
                jsonschema.validate(value, schema)
    assert checked >= 20  # enough mutations survive for the check to mean something


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(("text", "says"), [
    (json.dumps({"type": "array", "uniqueItems": True}), "`uniqueItems` is not supported"),
    (json.dumps({"properties": {"n": {"not": {"type": "string"}}}}), "#/properties/n: `not` is not supported"),
    (json.dumps({"$defs": {"a/b": {"if": {}, "then": {}}}, "$ref": "#/$defs/a~1b"}),
     "#/$defs/a~1b: `if`, `then` are not"),
    (json.dumps({"$ref": "#/$defs/missing"}), "does not exist"),
    (json.dumps({"type": "text"}), "text"),
    (json.dumps({"type": "string", "pattern": "(a"}), "regex parse error"),
    (json.dumps({"type": "string", "format": "nope"}), "Unknown format"),
    (json.dumps({"allOf": [{"type": "string"}, {"type": "null"}]}), "Unsatisfiable"),
    (json.dumps({"$ref": "http://example.com/s.json"}), "does not fetch"),
    ("{type: object}", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps(nested(300)), "deeper than 100 levels"),
    ("[" * 200_000 + "]" * 200_000, "bytes"),
    (json.dumps({"enum": [f"value number {i}" for i in range(300_000)]}), "the limit is 65536 bytes"),
])
def test_schemas_that_cannot_be_enforced_or_break_a_limit_are_refused_naming_why(text, says):
    with pytest.raises(SchemaError) as info:
        matcher(text)
    assert says in str(info.value)
    with pytest.raises(SchemaError):  # the refusal is remembered: the same text again fails the same way
        matcher(text)


def test_deep_nesting_within_the_byte_limit_is_a_schema_error_not_a_recursion_error():
    for text in ("[" * 30_000 + "]" * 30_000, json.dumps(nested(300))):
        with pytest.raises(SchemaError, match="deeper than"):
            grammars(schema_bytes=1 << 20).matcher(text)


def test_llguidance_limits_refuse_a_grammar_too_big_to_build():
    big = json.dumps({"enum": [f"value {i} of a long enum" for i in range(20_000)]})  # 600 KB
    with pytest.raises(SchemaError, match="too big|limit"):
        grammars(schema_bytes=1 << 20, lexer_fuel=100_000).matcher(big)


def test_the_hostile_recursive_alternatives_schema_compiles_and_stays_bounded():
    text = ('{"$defs":{"x":{"anyOf":[{"type":"array","minItems":1,"items":{"$ref":"#/$defs/x"}},'
            '{"type":"array","minItems":1,"items":{"$ref":"#/$defs/x"}}]}},"$ref":"#/$defs/x"}')
    m = matcher(text)
    for _ in range(64):
        assert any(m.compute_bitmask())
        assert m.consume_token(ord("[")), m.get_error()


def test_a_cached_schema_gives_a_fresh_matcher_each_time_and_the_cache_is_bounded():
    cache = grammars()
    text = json.dumps(PERSON)
    first = cache.matcher(text)
    assert first.consume_tokens(list(b'{"name"'))
    second = cache.matcher(text)  # at the start again, whatever the first one consumed
    assert second.consume_token(ord("{")) and not second.consume_token(ord("["))
    for i in range(200):
        cache.matcher(json.dumps({"type": "string", "title": f"t{i}"}))
    assert len(cache._entries) <= 64 and cache._bytes <= 8 << 20


def test_check_schema_needs_no_tokenizer():
    check_schema(json.dumps(PERSON))
    with pytest.raises(SchemaError, match="#: `uniqueItems` is not supported"):
        check_schema(json.dumps({"type": "array", "uniqueItems": True}))


def test_declared_properties_close_the_object_unless_the_schema_says_otherwise():
    declared = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert accepts(declared, '{"a": 1}') and accepts(declared, "{}")
    assert not accepts(declared, '{"a": 1, "b": 2}')
    assert not accepts({"type": "array", "items": declared}, '[{"a": 1, "b": 2}]')
    extra = {**declared, "additionalProperties": {"type": "string"}}
    assert accepts(extra, '{"a": 1, "b": "x"}') and not accepts(extra, '{"a": 1, "b": 2}')
    assert accepts({"type": "object"}, '{"b": 2}')  # JSON mode stays open


ENUM_SCHEMA = json.dumps({"enum": [f"value {i}" for i in range(4700)]})  # 65 kB, about 10 ms to compile


def test_a_compile_that_cannot_start_within_the_limit_is_busy_and_leaves_nothing_behind():
    """The pool's workers held (as a flood of slow schemas would hold them): the schema is not at fault, so it is
    not refused for later, and its queued compile is cancelled rather than left to run after the wait."""
    pool, release = grammar_module._COMPILE_POOL, threading.Event()
    held = [pool.submit(None, release.wait, 60) for _ in range(pool.workers)]
    cache = grammars(compile_timeout_s=1.0)
    try:
        with pytest.raises(CompileBusy, match="waited 1 s for a compiler"):
            cache.matcher(ENUM_SCHEMA)
        assert ENUM_SCHEMA not in cache._entries
    finally:
        release.set()
        for job in held:
            job.result()
    assert cache.matcher(ENUM_SCHEMA).consume_token(ord('"'))  # the same cache compiles it now


def test_a_compile_still_running_at_the_limit_is_refused_until_done_then_served_without_a_second_compile():
    for _ in range(100):  # a 2 ms wait on a 10 ms compile: late, unless the compile had not even started
        cache = grammars(compile_timeout_s=0.002)
        try:
            cache.matcher(ENUM_SCHEMA)
        except SchemaError as e:
            assert str(e) == "the schema did not compile within 0.002 s"
            break
        except CompileBusy:
            continue
    else:
        pytest.fail("the compile never ran past its wait")
    pending = cache._entries[ENUM_SCHEMA]
    assert isinstance(pending, _Pending)
    try:  # asked again at once: refused while it runs, nothing submitted again; served if it has just finished
        cache.matcher(ENUM_SCHEMA)
    except SchemaError as e:
        assert str(e) == "the schema did not compile within 0.002 s" and cache._entries[ENUM_SCHEMA] is pending
    else:
        assert pending.future.done()
    pending.future.result()
    assert cache.matcher(ENUM_SCHEMA).consume_token(ord('"'))  # its result, with no second compile
    assert cache._entries[ENUM_SCHEMA] is not pending and not isinstance(cache._entries[ENUM_SCHEMA], _Pending)
    assert grammars().matcher(ENUM_SCHEMA).consume_token(ord('"'))  # within the default limit it compiles


def test_one_tenant_holds_at_most_its_share_of_the_compilers(monkeypatch):
    """A tenant whose schemas compile slowly (as hostile ones would) gets CompileBusy for a third one at once,
    without waiting; another tenant's schema compiles meanwhile; once the first tenant's compiles end, it may
    compile again."""
    gate, started = threading.Event(), threading.Semaphore(0)
    real = grammar_module.llguidance.LLMatcher

    def slow(tokenizer, grammar, **kw):
        if "held" in str(grammar):
            started.release()
            gate.wait(60)
        return real(tokenizer, grammar, **kw)

    slow.grammar_from_json_schema = real.grammar_from_json_schema
    monkeypatch.setattr(grammar_module.llguidance, "LLMatcher", slow)
    cache = grammars(compile_timeout_s=30.0)
    held = [json.dumps({"type": "object", "properties": {f"held{i}": {"type": "integer"}}}) for i in range(3)]
    with ThreadPoolExecutor(2) as waiters:
        first = [waiters.submit(cache.matcher, text, True, "tenant-a") for text in held[:2]]
        for _ in range(2):
            assert started.acquire(timeout=30)  # both of tenant a's compiles hold a compiler
        with pytest.raises(CompileBusy, match="already has 2 schemas compiling"):
            cache.matcher(held[2], True, "tenant-a")
        assert held[2] not in cache._entries  # not refused for later
        assert cache.matcher(ENUM_SCHEMA, True, "tenant-b").consume_token(ord('"'))  # others still compile
        gate.set()
        assert all(f.result(30).consume_token(ord("{")) for f in first)
    assert cache.matcher(held[2], True, "tenant-a").consume_token(ord("{"))
    assert grammar_module._COMPILE_POOL.held("tenant-a") == 0  # every count released
