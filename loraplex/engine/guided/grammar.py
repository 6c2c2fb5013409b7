"""JSON Schema text -> a compiled llguidance matcher: bounded in size, depth, time and fuel, and cached.

Why a cache: the platform prepares one request more than once (to count its tokens, to generate, once
more per extra choice of `n`), and tool calls repeat their schema; a hit is a deep copy of a compiled
matcher (microseconds), bounded by entries and bytes. Refusals are cached too, so a bad schema sent
again costs a lookup.

Compiles run in a small pool, each waited for at most compile_timeout_s:
- one that has not started by then (other schemas hold the pool) is cancelled and CompileBusy raised: the
  schema is not at fault, nothing is cached, and the queue cannot grow past what the waits admit;
- one still running is left to finish (its fuel bounds it) and cached as pending: the schema is refused
  until it is done, and then served or refused from its result, without compiling it again;
- one owner (a tenant: the request's cache salt) has at most COMPILES_PER_OWNER compiles queued or running,
  across every model, and a free thread goes to the tenant with the fewest running (compile_pool.py): a tenant
  sending many slow schemas gets CompileBusy for its own, and other tenants' schemas go ahead of its backlog.

What llguidance enforces that the old matcher refused: `pattern`, `format`, number bounds, `multipleOf`.
What it cannot enforce (`uniqueItems`, `not`, `if`, ...) is refused with the keywords named.
Whitespace between tokens is flexible but capped, so a model cannot loop on blank lines.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance

from loraplex.engine.config import EngineConfig
from loraplex.engine.guided.compile_pool import CompileBusy, FairCompilePool
from loraplex.engine.guided.tokenizer import GuideTokenizer

MAX_WS = 32  # whitespace bytes between two tokens of the JSON text
OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WS}}}", "json_allow_general_unicode_escapes": True}
MAX_DEPTH = 100  # JSON nesting of a schema document (llguidance's own parser stops at 128)
CACHE_ENTRIES = 64
CACHE_BYTES = 8 << 20  # schema texts (each at most guided_schema_max_bytes) and refusals
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
COMPILES_PER_OWNER = 2  # of the pool's 4 threads, the most one owner's schemas may hold or wait for
_COMPILE_POOL = FairCompilePool(workers=4, per_owner=COMPILES_PER_OWNER, name="guided-compile")


class SchemaError(ValueError):
    """The schema is not JSON Schema, breaks a limit, or uses a keyword guided decoding cannot enforce."""


@dataclass(frozen=True)
class _Pending:
    """A compile that outlived its request's wait: its result, once there, becomes the cache entry."""

    future: Future
    schema: dict | None  # for explain()


@dataclass(frozen=True)
class GuideLimits:
    """Per-request bounds of guided decoding: EngineConfig's guided_* fields (their defaults live there)."""

    schema_bytes: int
    compile_timeout_s: float
    mask_timeout_s: float
    max_grammar_size: int
    lexer_fuel: int
    step_lexer_fuel: int
    step_max_items: int
    max_lexer_states: int

    @classmethod
    def from_config(cls, c: EngineConfig | None = None) -> GuideLimits:
        c = c or EngineConfig()
        return cls(c.guided_schema_max_bytes, c.guided_compile_timeout_s, c.guided_mask_timeout_s,
                   c.guided_max_grammar_size, c.guided_lexer_fuel, c.guided_step_lexer_fuel,
                   c.guided_step_max_items, c.guided_max_lexer_states)

    def parser_limits(self) -> llguidance.LLParserLimits:
        """llguidance's fuel and size limits; errors name no schema internals (they reach the client)."""
        return llguidance.LLParserLimits(
            initial_lexer_fuel=self.lexer_fuel, step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items, max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size, verbose_errors=False)


def _depth(value) -> int:
    """Nesting depth of a parsed JSON document, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def subschemas(schema: dict):
    """Every subschema of a schema document with its JSON pointer ("#/properties/a"), without recursion."""
    stack = [("#", schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield path, node
        stack.extend((f"{path}/{k}", node[k]) for k in _SUBSCHEMA if k in node)
        for k in _SUBSCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                stack.extend((f"{path}/{k}/{_escape(name)}", v) for name, v in node[k].items())
        for k in _SUBSCHEMA_LISTS:
            if isinstance(node.get(k), list):
                stack.extend((f"{path}/{k}/{i}", v) for i, v in enumerate(node[k]))


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def close_objects(schema: dict) -> dict:
    """The schema with `additionalProperties: false` wherever `properties` is declared and nothing says
    otherwise, in place: the output holds the declared keys only, in their order (as OpenAI's structured
    outputs), and still validates against the schema as given."""
    for _, node in subschemas(schema):
        if "properties" in node and not {"additionalProperties", "patternProperties",
                                         "unevaluatedProperties"} & node.keys():
            node["additionalProperties"] = False
    return schema


def grammar_for(text: str, limits: GuideLimits) -> tuple[dict, str]:
    """Checks the schema document (bytes, JSON, object, depth); returns it parsed, and llguidance's
    grammar for it."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.schema_bytes:
        raise SchemaError(f"the schema is {size} bytes; the limit is {limits.schema_bytes} bytes")
    try:
        schema = json.loads(text)
    except RecursionError:
        raise SchemaError(f"the schema nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise SchemaError(f"not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise SchemaError("a schema must be a JSON object")
    if _depth(schema) > MAX_DEPTH:
        raise SchemaError(f"the schema nests deeper than {MAX_DEPTH} levels")
    try:
        return schema, llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema), defaults=OPTIONS)
    except ValueError as e:
        raise SchemaError(str(e)) from None


def explain(error: str, schema: dict | None = None) -> str:
    """llguidance's error as a client reads it: the keywords it cannot enforce (where, given the
    schema), or its first line."""
    m = _UNIMPLEMENTED.search(error)
    if m:
        try:
            keys = [str(k) for k in json.loads(m.group(1))]
        except ValueError:
            keys = []
        if keys:
            where = next((path for path, node in subschemas(schema) if keys[0] in node), None) if schema else None
            named = ", ".join(f"`{k}`" for k in keys)
            return f"{where + ': ' if where else ''}{named} {'is' if len(keys) == 1 else 'are'} not supported " \
                   "(guided decoding cannot enforce it)"
    return error.replace("<non-verbose/>", "").strip().splitlines()[0][:300] if error.strip() else "unknown error"


def check_schema(text: str, limits: GuideLimits | None = None) -> None:
    """Raises SchemaError for a schema that no tokenizer could compile (the CLI, before a model loads)."""
    limits = limits or GuideLimits.from_config()
    schema, grammar = grammar_for(text, limits)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=limits.parser_limits())
    if failed:
        raise SchemaError(explain(messages[0], schema))


class GrammarCache:
    """Compiled matchers by schema text for one tokenizer, least recently used out, bounded by entries
    and bytes. Thread-safe: requests are prepared on the callers' threads."""

    def __init__(self, tokenizer: Callable[[], GuideTokenizer], limits: GuideLimits):
        self._tokenizer = tokenizer
        self.limits = limits
        self._entries: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()  # a matcher or a refusal
        self._bytes = 0
        self._lock = threading.Lock()

    def matcher(self, text: str, compile: bool = True, owner: str | None = None) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `text`'s schema; SchemaError says why it cannot be, CompileBusy that
        it could not be compiled now (or, with compile False, that it is not cached: the caller must not
        compile, and the request may try again). owner: whose compiles count against COMPILES_PER_OWNER
        (None: no limit)."""
        if len(text) > self.limits.schema_bytes:  # before any work on it (characters <= bytes)
            raise SchemaError(f"the schema has {len(text)} characters; the limit is {self.limits.schema_bytes} bytes")
        with self._lock:
            hit = self._entries.get(text)
            if hit is not None:
                self._entries.move_to_end(text)
        if isinstance(hit, _Pending):
            if not hit.future.done():
                raise SchemaError(self._late())
            hit = self._result(hit)
            self._remember(text, hit)
        elif hit is None:
            if not compile:
                raise CompileBusy("the schema is not compiled: prepare() compiles it, and other schemas "
                                  "pushed it out of the cache since; try again")
            try:
                hit = self._compile(text, owner)
            except SchemaError as e:
                hit = str(e)
            self._remember(text, hit)
        if isinstance(hit, _Pending):
            raise SchemaError(self._late())
        if isinstance(hit, str):
            raise SchemaError(hit)
        return hit.deep_copy()

    def _late(self) -> str:
        return f"the schema did not compile within {self.limits.compile_timeout_s:g} s"

    def _compile(self, text: str, owner: str | None) -> llguidance.LLMatcher | _Pending:
        schema, grammar = grammar_for(text, self.limits)
        tokenizer = self._tokenizer()
        # llguidance drops the GIL while it builds; the wait is bounded here, its work by the fuel limits
        future = _COMPILE_POOL.submit(owner, llguidance.LLMatcher, tokenizer.ll, grammar, log_level=0,
                                      limits=self.limits.parser_limits())
        try:
            future.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeout:
            if future.cancel():  # never started: the pool was busy with other schemas
                raise CompileBusy(f"the schema waited {self.limits.compile_timeout_s:g} s for a compiler (others "
                                  "held them all); try again") from None
            return _Pending(future, schema)
        return self._result(_Pending(future, schema))

    @staticmethod
    def _result(done: _Pending) -> llguidance.LLMatcher | str:
        """A finished compile's matcher, or its refusal."""
        matcher = done.future.result()
        return explain(matcher.get_error(), done.schema) if matcher.is_error() else matcher

    def _remember(self, text: str, entry: llguidance.LLMatcher | str | _Pending) -> None:
        """Caches the entry; a pending compile's is replaced by its result, any other is kept."""
        with self._lock:
            held = self._entries.get(text)
            if held is not None and not isinstance(held, _Pending):
                return
            if held is not None:
                self._bytes -= _cost(text, held)
            self._entries[text] = entry
            self._bytes += _cost(text, entry)
            while self._entries and (len(self._entries) > CACHE_ENTRIES or self._bytes > CACHE_BYTES):
                old, value = self._entries.popitem(last=False)
                self._bytes -= _cost(old, value)


def _cost(text: str, entry) -> int:
    """An entry's bytes as the cache counts them: its schema text, a refusal's message, and 256 for the rest."""
    return len(text) + (len(entry) if isinstance(entry, str) else 0) + 256
