"""What gpt-oss writes after a Harmony chat prompt, emulated: its reasoning in the `analysis`
channel (longer at a higher reasoning effort), then either a tool call in `commentary` to
`functions.X` with JSON arguments valid against the tool's schema, or the answer in `final`
(JSON valid against `json_schema` when one constrains it).

The answer is decided by the conversation alone (and the request's seed), never by the tokens
already written: a request resumed on another worker, whose prompt is the conversation plus
the answer so far, gets the same answer and continues it where it was cut, in the same
channel, as the model would continue its own text.

Tools reach the emulator as SGLang's function-calling constraint (`structural_tag`: each
function's begin string and argument schema), which the gateway sends whenever a client
offers tools; the emulated model calls the first one when the user spoke last, and answers
when a tool's result came last.
"""

from __future__ import annotations

import bisect
import json
import random
import re
import zlib
from dataclasses import dataclass
from typing import Any

from core import harmony
from core.tokens import SyntheticText
from nodes.emulator.json_instance import UnsupportedSchema, instance
from nodes.emulator.params import RequestError

ASSISTANT = 173781  # the token "assistant" (a role after <|start|>)
USER = 1428  # the token "user"
ANALYSIS = 35644  # the token "analysis" (a channel)
# Share of an answer's tokens spent reasoning, by effort (gpt-oss reasons longer when asked).
REASONING_SHARE = {"low": 0.2, "medium": 0.45, "high": 0.7}
_EFFORT = re.compile(r"Reasoning: (low|medium|high)")
_FUNCTION = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")


class ConstraintError(RequestError):
    """A constraint the emulator cannot satisfy (refused as SGLang refuses a bad grammar)."""


def constraints(sampling: dict[str, Any], prompt_ids: list[int] | None) -> dict[str, Any]:
    """What the prompt and the grammar parameters ask of the answer, as GenerateSpec fields.
    `regex` and `ebnf` are refused: the emulator cannot write text a general grammar accepts
    (a real SGLang site decodes under them)."""
    for name in ("regex", "ebnf"):
        if sampling.get(name) is not None:
            raise ConstraintError(f"{name} constraints are not supported by the SGLang emulator; use json_schema")
    schema = json_schema_of(sampling.get("json_schema"))
    if schema is not None:
        try:
            instance(schema, random.Random(0))  # refused now, not mid-answer
        except UnsupportedSchema as exc:
            raise ConstraintError(f"json_schema: {exc}") from None
    return {
        "harmony": read_prompt(prompt_ids) if prompt_ids else None,
        "tools": tuple(tools_of(sampling.get("structural_tag"))),
        "json_schema": schema,
    }


@dataclass(frozen=True, slots=True)
class Prompt:
    """A Harmony chat prompt: the conversation before the answer, and the answer so far."""

    conversation: tuple[int, ...]
    written: int  # answer tokens already in the prompt (a resumed request)
    effort: str
    user_spoke_last: bool


def read_prompt(ids: list[int]) -> Prompt | None:
    """The Harmony context of a prompt, or None if it does not end inside an assistant turn.
    The answer being written is the prompt's trailing assistant messages that are open or are
    reasoning (what a model writes before its answer or call); a finished assistant message
    (an answer, a call) belongs to the conversation."""
    starts = [i for i, token in enumerate(ids) if token == harmony.START]
    begin = None
    for n in range(len(starts) - 1, -1, -1):
        i, end = starts[n], starts[n + 1] if n + 1 < len(starts) else len(ids)
        if i + 1 >= len(ids) or ids[i + 1] != ASSISTANT:
            break
        message = ids[i:end]
        closed = any(t in (harmony.END, harmony.CALL, harmony.RETURN) for t in message)
        header = message[: message.index(harmony.MESSAGE)] if harmony.MESSAGE in message else message
        if closed and ANALYSIS not in header:
            break
        begin = n
    if begin is None or begin == 0:
        return None
    start = starts[begin] + 2
    system_end = ids.index(harmony.END) if harmony.END in ids else 0
    effort = _EFFORT.search(harmony.encoding().decode(ids[:system_end]))
    spoke_last = ids[starts[begin - 1] + 1] == USER
    return Prompt(tuple(ids[:start]), len(ids) - start, effort.group(1) if effort else "medium", spoke_last)


def tools_of(structural_tag: str | None) -> list[tuple[str, dict[str, Any]]]:
    """(name, argument schema) of each function a `structural_tag` constraint allows."""
    if not structural_tag:
        return []
    try:
        tag = json.loads(structural_tag)
        structures = tag["structures"]
        return [(_FUNCTION.search(s["begin"]).group(1), s.get("schema") or {}) for s in structures]  # type: ignore[union-attr]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConstraintError("structural_tag must be JSON with structures of {begin, schema, end}") from None


def json_schema_of(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        schema = json.loads(raw)
    except ValueError:
        raise ConstraintError("json_schema is not valid JSON") from None
    if not isinstance(schema, dict):
        raise ConstraintError("json_schema must be a JSON object")
    return schema


@dataclass(frozen=True, slots=True)
class Listed:
    """An answer's tokens written out: ids and the text each shows (specials show nothing, as
    with SGLang's default skip_special_tokens). Read like SyntheticText, from offset 0."""

    ids: tuple[int, ...]
    char_starts: tuple[int, ...]
    text: str

    @classmethod
    def of(cls, parts: list[tuple[list[int], list[str]]]) -> Listed:
        ids: list[int] = []
        pieces: list[str] = []
        for part_ids, part_pieces in parts:
            ids += part_ids
            pieces += part_pieces
        starts = [0]
        for piece in pieces:
            starts.append(starts[-1] + len(piece))
        return cls(tuple(ids), tuple(starts), "".join(pieces))

    @property
    def period(self) -> int:
        return 1 << 62  # never wraps

    def window(self, offset: int, n: int) -> tuple[str, list[int]]:
        return self.text[self.char_starts[offset] : self.char_starts[offset + n]], list(self.ids[offset : offset + n])

    def tokens_covering(self, offset: int, char_end: int) -> int:
        return bisect.bisect_left(self.char_starts, self.char_starts[offset] + char_end) - offset


def _specials(text: str) -> tuple[list[int], list[str]]:
    ids = harmony.encoding().encode(text, allowed_special="all")
    return ids, ["" if i >= harmony.FIRST_SPECIAL else harmony.encoding().decode([i]) for i in ids]


def _plain(text: str) -> tuple[list[int], list[str]]:
    ids = harmony.encode(text)
    return ids, [harmony.encoding().decode([i]) for i in ids]  # ASCII: every id is whole characters


def _words(synth: SyntheticText, rng: random.Random, n: int) -> tuple[list[int], list[str]]:
    offset = rng.randrange(synth.period)
    ids = list(synth.window(offset, n)[1])
    start = offset % synth.period
    pieces = [synth.text[synth.char_starts[start + i] : synth.char_starts[start + i + 1]] for i in range(n)]
    return ids, pieces


def rng_for(prompt: Prompt, seed: int | None) -> random.Random:
    """The answer's randomness: the conversation's and the request's seed, nothing else."""
    return random.Random(zlib.crc32(json.dumps(prompt.conversation).encode()) ^ (seed or 0))


def plan(
    prompt: Prompt,
    *,
    rng: random.Random,
    synth: SyntheticText,
    natural_tokens: int,
    tools: list[tuple[str, dict[str, Any]]],
    json_schema: dict[str, Any] | None,
) -> Listed:
    """The whole answer to `prompt`'s conversation (the caller starts it at `prompt.written`)."""
    reasoning = max(1, round(natural_tokens * REASONING_SHARE[prompt.effort]))
    parts = [_specials("<|channel|>analysis<|message|>"), _words(synth, rng, reasoning)]
    parts.append(_specials("<|end|><|start|>assistant"))
    try:
        if tools and prompt.user_spoke_last:
            name, schema = tools[0]
            arguments = json.dumps(instance(schema, rng), separators=(",", ":"))
            parts += [_specials(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>")]
            parts += [_plain(arguments), _specials("<|call|>")]
            return Listed.of(parts)
        parts.append(_specials("<|channel|>final<|message|>"))
        if json_schema is not None:
            parts.append(_plain(json.dumps(instance(json_schema, rng), separators=(",", ":"))))
        else:
            parts.append(_words(synth, rng, max(1, natural_tokens - reasoning)))
    except UnsupportedSchema as exc:
        raise ConstraintError(str(exc)) from None
    parts.append(_specials("<|return|>"))
    return Listed.of(parts)


def constrained_json(schema: dict[str, Any], seed: int | None) -> Listed:
    """The whole output of a plain (not chat) prompt under `json_schema`: the document, then EOS."""
    try:
        text = json.dumps(instance(schema, random.Random(seed)), separators=(",", ":"))
    except UnsupportedSchema as exc:
        raise ConstraintError(str(exc)) from None
    return Listed.of([_plain(text), _specials("<|return|>")])
