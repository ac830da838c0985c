"""A JSON value that satisfies a JSON schema: what a constrained decoder makes the model write.

SGLang's grammar backends turn `json_schema` into a grammar and the model can then only write
documents the schema accepts. The emulator has no model, so it writes a small, plausible
instance directly. It covers what API users put in schemas (OpenAI's strict subset and then
some: objects, arrays, scalars with bounds, enums, const, anyOf/oneOf/allOf, local $refs);
a schema it cannot satisfy (`pattern`, `not`, `multipleOf`, a `$ref` outside the document) is refused when
the request arrives, as a grammar backend refuses one it cannot compile.
"""

from __future__ import annotations

import math
import random
from typing import Any

WORDS = ("alpha", "river", "stone", "cloud", "north", "amber", "delta", "maple", "quiet", "orbit")
MAX_DEPTH = 12  # a recursive schema is written to this depth, then its smallest choice


class UnsupportedSchema(ValueError):
    """A schema the emulator cannot write an instance of."""


MAX_NESTING = 64  # deeper than this, a schema recurses without end (a $ref loop through required fields)
MAX_SIZE = 10_000  # items or characters the emulator writes for one value at most


def instance(schema: Any, rng: random.Random) -> Any:
    """Raises UnsupportedSchema for any schema it cannot write an instance of, malformed ones
    included (a bound that is not a number, an empty anyOf, a loop of $refs)."""
    if not isinstance(schema, dict):
        raise UnsupportedSchema("a JSON schema must be an object")
    try:
        defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
        return _value(schema, rng, defs, 0)
    except UnsupportedSchema:
        raise
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:
        raise UnsupportedSchema(f"the schema is malformed ({type(exc).__name__}: {exc})") from None


def _value(schema: Any, rng: random.Random, defs: dict[str, Any], depth: int) -> Any:
    if depth > MAX_NESTING:
        raise UnsupportedSchema("the schema recurses without end")
    if schema is True or schema == {}:
        return rng.choice(WORDS)
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"not a schema: {schema!r}")
    for keyword in ("pattern", "not", "patternProperties", "if", "multipleOf"):
        if keyword in schema:
            raise UnsupportedSchema(f"`{keyword}` is not supported by the emulator's constrained decoding")
    if "$ref" in schema:
        ref = schema["$ref"]
        name = ref.rsplit("/", 1)[-1]
        if not (ref.startswith("#/$defs/") or ref.startswith("#/definitions/")) or name not in defs:
            raise UnsupportedSchema(f"$ref {ref!r} does not name a definition in the schema")
        return _value(defs[name], rng, defs, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        if not schema["enum"]:
            raise UnsupportedSchema("an empty enum has no instance")
        return rng.choice(schema["enum"])
    for keyword in ("anyOf", "oneOf"):
        if keyword in schema:
            return _value(schema[keyword][0], rng, defs, depth + 1)
    if "allOf" in schema:
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            for key, value in part.items():
                merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
        return _value(merged, rng, defs, depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        names = list(properties) if depth < MAX_DEPTH else [n for n in properties if n in required]
        return {name: _value(properties[name], rng, defs, depth + 1) for name in names}
    if kind == "array":
        low = schema.get("minItems", 0)
        if low > MAX_SIZE:
            raise UnsupportedSchema(f"minItems over {MAX_SIZE}")
        high = schema.get("maxItems", max(low, 2))
        count = low if depth >= MAX_DEPTH else min(high, max(low, 1 + rng.randrange(2)))
        items = schema.get("items", {})
        return [_value(items, rng, defs, depth + 1) for _ in range(count)]
    if kind == "string":
        return _string(schema, rng)
    if kind in ("integer", "number"):
        return _number(schema, rng, kind == "integer")
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    raise UnsupportedSchema(f"unknown type {kind!r}")


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    formats = {"date": "2026-12-05", "date-time": "2026-12-05T12:00:00Z", "email": "user@example.com"}
    text = formats.get(schema.get("format", ""), " ".join(rng.choice(WORDS) for _ in range(1 + rng.randrange(3))))
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if low > MAX_SIZE:
        raise UnsupportedSchema(f"minLength over {MAX_SIZE}")
    while len(text) < low:
        text += " " + rng.choice(WORDS)
    return text[:high] if high is not None else text


def _number(schema: dict[str, Any], rng: random.Random, integer: bool) -> int | float:
    low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
    high = schema.get("maximum", schema.get("exclusiveMaximum", low + 100))
    if "exclusiveMinimum" in schema:
        low += 1 if integer else 0.5
    if "exclusiveMaximum" in schema:
        high -= 1 if integer else 0.5
    if high < low:
        raise UnsupportedSchema("the schema's bounds leave no number")
    if integer:
        low_i, high_i = math.ceil(low), math.floor(high)
        if high_i < low_i:
            raise UnsupportedSchema("the schema's bounds leave no integer")
        return rng.randint(low_i, high_i)
    return min(max(round(rng.uniform(low, high), 2), low), high)
