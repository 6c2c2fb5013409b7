"""JSON Schema -> a small grammar of value nodes that the byte matcher (matcher.py) walks.

Why a subset: every keyword kept here is one the matcher can enforce while the text is generated, so
an output that completes always validates against the schema. A keyword it cannot enforce (`pattern`,
`multipleOf`, `uniqueItems`, ...) is refused with an error naming it, never silently dropped; annotations
(`title`, `description`, `format`, `default`, ...) are ignored, as JSON Schema allows.

Kept: `type` (one or a list), `enum`, `const`, `properties` + `required` + `additionalProperties`,
`items`, `minItems`, `maxItems`, `minLength` / `maxLength` (characters), `minimum` / `maximum` /
`exclusiveMinimum` / `exclusiveMaximum` on integers (not on non-integer numbers, which are refused),
`anyOf` / `oneOf` (both as "any of": exclusivity is not checked),
`allOf` of one schema, and `$ref` into the same document (`#`, `#/$defs/...`, `#/definitions/...`,
recursion included).

Choices the matcher makes inside what the schema allows: an object with `properties` gets its keys in
the order declared, each required one present, optional ones skippable, and no other keys (so a
schema with `properties` and `additionalProperties` other than false still validates every output).
An object without `properties` takes any string keys, with values of `additionalProperties` (any
JSON value when it is absent or true). Literals (`enum`, `const`) are written compactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache

# Node kinds (tuples, so matcher states built from node ids stay hashable):
#   ("obj", props, free)                        props: ((key bytes incl. closing quote, node, required), ...)
#                                               free: node of a free-keyed object's values, or None
#   ("arr", item, min_items, max_items | None)
#   ("str",)                                    any JSON string
#   ("lstr", min_length, max_length | None)     a string of that many characters (code points)
#   ("num", integer_only)
#   ("int", minimum | None, maximum | None)     an integer within bounds (inclusive)
#   ("lit", (bytes, ...))                       one of these compact JSON texts
#   ("union", (node, ...))                      any of these

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "format", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions", "contentEncoding", "contentMediaType", "discriminator"})
LENGTHS = ("minLength", "maxLength")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
KEYWORDS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "anyOf", "oneOf", "allOf", "$ref", *LENGTHS, *BOUNDS})
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
MAX_NODES = 2000  # a schema that needs more is refused: each request compiles it


class SchemaError(ValueError):
    """The schema is not JSON Schema, or uses a keyword the matcher cannot enforce."""


@dataclass(eq=False)
class Grammar:
    """Compiled schema: nodes by id, `root` the value to generate. Compared by identity, which keeps
    per-grammar caches cheap; `compile_schema` returns one object per schema text."""

    nodes: list[tuple] = field(default_factory=list)
    root: int = 0

    def add(self, node: tuple) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"the schema is too large (more than {MAX_NODES} nodes)")
        self.nodes.append(node)
        return len(self.nodes) - 1


def literal(value) -> bytes:
    """A JSON value's compact text, as the matcher expects it for enum and const."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@lru_cache(maxsize=256)
def compile_schema(text: str) -> Grammar:
    """Schema text (JSON) -> Grammar; raises SchemaError with the offending path and keyword."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise SchemaError(f"the schema is not valid JSON: {e}") from None
    return _Compiler(schema).grammar


class _Compiler:
    def __init__(self, root):
        self.root = root
        self.grammar = Grammar()
        self.refs: dict[str, int] = {}  # "$ref" target -> node id (placeholders filled once compiled)
        # Any JSON value: a union of the five shapes, objects and arrays holding any values again.
        g = self.grammar
        self.any = g.add(("union", ()))
        shapes = (g.add(("obj", (), self.any)), g.add(("arr", self.any, 0, None)), g.add(("str",)),
                  g.add(("num", False)), g.add(("lit", (b"true", b"false", b"null"))))
        g.nodes[self.any] = ("union", shapes)
        self.grammar.root = self.node(root, "#")
        self.check_unions()

    def check_unions(self) -> None:
        """A `$ref` loop through unions alone (`{"$ref": "#"}`) never reaches a value: refuse it."""
        nodes = self.grammar.nodes
        done: set[int] = set()

        def visit(n: int, trail: frozenset) -> None:
            if nodes[n][0] != "union" or n in done:
                return
            if n in trail:
                raise SchemaError("the schema refers to itself without ever describing a value ($ref loop)")
            for alt in nodes[n][1]:
                visit(alt, trail | {n})
            done.add(n)

        for n in range(len(nodes)):
            visit(n, frozenset())

    def node(self, schema, path: str) -> int:
        if schema is True or schema == {}:
            return self.any
        if schema is False:
            raise SchemaError(f"{path}: the schema `false` allows no value")
        if not isinstance(schema, dict):
            raise SchemaError(f"{path}: a schema must be an object or a boolean, got {type(schema).__name__}")
        unknown = sorted(set(schema) - KEYWORDS - ANNOTATIONS)
        if unknown:
            raise SchemaError(f"{path}: `{unknown[0]}` is not supported (supported: {', '.join(sorted(KEYWORDS))})")
        if "$ref" in schema:
            if len(set(schema) - ANNOTATIONS) > 1:
                raise SchemaError(f"{path}: `$ref` beside other keywords is not supported")
            return self.ref(schema["$ref"], path)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.union(schema, key, path)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or len(set(schema) - ANNOTATIONS) > 1:
                raise SchemaError(f"{path}: `allOf` is supported only as a list of one schema, alone")
            return self.node(parts[0], f"{path}/allOf/0")
        if "const" in schema or "enum" in schema:
            return self.literals(schema, path)
        types = schema.get("type")
        if types is None and any(k in schema for k in LENGTHS + BOUNDS):
            key = next(k for k in LENGTHS + BOUNDS if k in schema)
            raise SchemaError(f"{path}: `{key}` needs a `type` (string for lengths, integer for bounds)")
        if types is None:
            types = [t for t, keys in (("object", ("properties", "required", "additionalProperties")),
                                        ("array", ("items", "minItems", "maxItems"))) if any(k in schema for k in keys)]
            if not types:
                return self.any
        names = [types] if isinstance(types, str) else types
        if not isinstance(names, list) or not names or any(t not in TYPES for t in names):
            raise SchemaError(f"{path}: `type` must be one of {', '.join(TYPES)} or a list of them, got {types!r}")
        alts = [self.typed(t, schema, path) for t in dict.fromkeys(names)]
        return alts[0] if len(alts) == 1 else self.grammar.add(("union", tuple(alts)))

    def typed(self, kind: str, schema: dict, path: str) -> int:
        g = self.grammar
        if kind == "object":
            return self.obj(schema, path)
        if kind == "array":
            return self.arr(schema, path)
        if kind == "string":
            lo, hi = self.count_range(schema, "minLength", "maxLength", path)
            return g.add(("str",) if (lo, hi) == (0, None) else ("lstr", lo, hi))
        if kind == "number":
            if any(k in schema for k in BOUNDS):
                key = next(k for k in BOUNDS if k in schema)
                raise SchemaError(f"{path}: `{key}` is supported on integers only, not on `number`")
            return g.add(("num", False))
        if kind == "integer":
            lo, hi = integer_bounds(schema, path)
            return g.add(("num", True) if (lo, hi) == (None, None) else ("int", lo, hi))
        if kind == "boolean":
            return g.add(("lit", (b"true", b"false")))
        return g.add(("lit", (b"null",)))

    def obj(self, schema: dict, path: str) -> int:
        props = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(props, dict):
            raise SchemaError(f"{path}/properties: must be an object")
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise SchemaError(f"{path}/required: must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"{path}/required: {missing[0]!r} is required but not among the properties")
        extra = schema.get("additionalProperties", True)
        node = self.grammar.add(("obj", (), None))  # placeholder first: a property may refer back to it
        if props:
            compiled = tuple((literal(name)[1:], self.node(sub, f"{path}/properties/{name}"), name in required)
                             for name, sub in props.items())
            self.grammar.nodes[node] = ("obj", compiled, None)
        elif extra is not False:
            self.grammar.nodes[node] = ("obj", (), self.node(extra, f"{path}/additionalProperties"))
        return node

    @staticmethod
    def count_range(schema: dict, low: str, high: str, path: str) -> tuple[int, int | None]:
        """minItems/maxItems or minLength/maxLength: non-negative integers, low <= high."""
        lo, hi = schema.get(low, 0), schema.get(high)
        for key, value in ((low, lo), (high, hi)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise SchemaError(f"{path}/{key}: must be a non-negative integer, got {value!r}")
        if hi is not None and hi < lo:
            raise SchemaError(f"{path}: {high} {hi} is below {low} {lo}")
        return lo, hi

    def arr(self, schema: dict, path: str) -> int:
        lo, hi = self.count_range(schema, "minItems", "maxItems", path)
        node = self.grammar.add(("arr", self.any, lo, hi))
        item = self.node(schema.get("items", True), f"{path}/items")
        self.grammar.nodes[node] = ("arr", item, lo, hi)
        return node

    def literals(self, schema: dict, path: str) -> int:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{path}/enum: must be a non-empty list")
        return self.grammar.add(("lit", tuple(dict.fromkeys(literal(v) for v in values))))

    def union(self, schema: dict, key: str, path: str) -> int:
        parts = schema[key]
        if not isinstance(parts, list) or not parts:
            raise SchemaError(f"{path}/{key}: must be a non-empty list of schemas")
        if len(set(schema) - ANNOTATIONS) > 1:
            raise SchemaError(f"{path}: `{key}` beside other keywords is not supported")
        alts = tuple(self.node(p, f"{path}/{key}/{i}") for i, p in enumerate(parts))
        return alts[0] if len(alts) == 1 else self.grammar.add(("union", alts))

    def ref(self, target, path: str) -> int:
        if not isinstance(target, str) or not target.startswith("#"):
            raise SchemaError(f"{path}/$ref: only references inside the schema (#/...) are supported, got {target!r}")
        if target in self.refs:
            return self.refs[target]
        # A placeholder union of one, filled once the target compiles: recursion refers to it meanwhile.
        node = self.refs[target] = self.grammar.add(("union", ()))
        resolved = self.root
        for part in filter(None, target[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(resolved, dict) or part not in resolved:
                raise SchemaError(f"{path}/$ref: {target!r} does not resolve")
            resolved = resolved[part]
        self.grammar.nodes[node] = ("union", (self.node(resolved, target),))
        return node


def integer_bounds(schema: dict, path: str) -> tuple[int | None, int | None]:
    """The inclusive integer range that minimum / maximum / exclusiveMinimum / exclusiveMaximum leave."""
    lows, highs = [], []
    for key in BOUNDS:
        if key not in schema:
            continue
        value = schema[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise SchemaError(f"{path}/{key}: must be a finite number, got {value!r}")
        if key == "minimum":
            lows.append(math.ceil(value))
        elif key == "exclusiveMinimum":
            lows.append(math.floor(value) + 1)
        elif key == "maximum":
            highs.append(math.floor(value))
        else:
            highs.append(math.ceil(value) - 1)
    lo, hi = (max(lows) if lows else None), (min(highs) if highs else None)
    if lo is not None and hi is not None and hi < lo:
        raise SchemaError(f"{path}: no integer lies within the bounds (from {lo} to {hi})")
    return lo, hi
