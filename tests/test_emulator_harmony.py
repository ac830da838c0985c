"""The emulated gpt-oss's Harmony answers, as pure functions: JSON that validates against the
schema it was asked for, and an answer that a resumed request continues exactly."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from core import harmony, tokens
from nodes.emulator.harmony_answer import constraints
from nodes.emulator.json_instance import UnsupportedSchema, instance
from nodes.emulator.output import GenerateSpec, plan_output

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 6}}, "required": ["a"]},
    {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "minItems": 3},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 30, "maxLength": 40}}},
    {"enum": ["x", 3, None]},
    {"anyOf": [{"type": "boolean"}, {"type": "string"}]},
    {"type": ["null", "string"], "format": "date-time"},
    {
        "$defs": {
            "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
        "$ref": "#/$defs/node",
    },
    {"allOf": [{"type": "object", "properties": {"a": {"const": 1}}}, {"required": ["a"]}]},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_instances_validate(schema) -> None:
    """Every instance the emulator writes under a schema validates against it (many seeds)."""
    for seed in range(20):
        jsonschema.validate(instance(schema, random.Random(seed)), schema)


def test_schemas_it_cannot_satisfy_are_refused() -> None:
    """A `pattern` (or a $ref outside the schema) is refused up front, not answered wrongly."""
    for schema in ({"type": "string", "pattern": "^a+$"}, {"$ref": "https://example.com/s.json"}):
        with pytest.raises(UnsupportedSchema):
            instance(schema, random.Random(0))


def _answer(prompt: list[int], sampling: dict) -> list[int]:
    synth = tokens.synthetic_text()
    spec = GenerateSpec("r", len(prompt), 8000, **constraints(sampling, prompt))
    plan = plan_output(spec, synth, 400)
    return plan.text_and_ids(synth, plan.tokens)[1]


def test_a_resumed_answer_continues_the_same_answer() -> None:
    """Cut anywhere, the prompt plus the answer so far gets the rest of the same answer, and
    the whole reads back as reasoning then a final answer under the schema."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    sampling = {"json_schema": json.dumps(schema)}
    prompt = harmony.render_chat([harmony.Turn("user", "Count.")], [], reasoning_effort="low", today="2026-12-05")
    whole = _answer(prompt, sampling)
    for cut in (1, 5, len(whole) // 2, len(whole) - 3):
        assert whole[:cut] + _answer(prompt + whole[:cut], sampling) == whole, cut
    reader = harmony.OutputReader()
    pieces = reader.feed(whole)
    assert [k for k, _ in pieces] == ["reasoning", "content"]
    jsonschema.validate(json.loads(pieces[1][1]), schema)
