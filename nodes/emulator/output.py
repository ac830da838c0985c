"""What a request will generate, decided when it arrives, as a model's output would be.

A real model's answer length is set by where it emits EOS, by a stop string or stop
token it happens to produce, or by `max_new_tokens`. The emulator draws the EOS point
from a seeded length distribution (mean like MLPerf's gpt-oss set), then applies the
request's stops to the synthetic text, so the engine knows the exact token count it
must emulate and every finish reason has SGLang's shape.

A Harmony chat prompt gets a Harmony answer (reasoning, then a tool call or the final answer:
nodes/emulator/harmony_answer.py), and a `json_schema` constraint a JSON document, both
written out token by token instead of read from the synthetic stream.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from core import tokens
from core.tokens import SyntheticText
from nodes.emulator import harmony_answer
from nodes.emulator.harmony_answer import Listed

EOS_TOKEN_ID = tokens.EOS_TOKEN_IDS[0]  # <|return|>: how a gpt-oss answer ends
OUTPUT_LENGTH_SIGMA = 0.8  # log-normal spread of natural answer lengths


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """One generation request, whichever API it came in through."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    seed: int | None = None
    streaming: bool = False
    stream_interval: int | None = None  # sampling_params.stream_interval; None: the server's
    prompt_ids: bytes = b""  # the prompt's token ids (radix_cache.pack_ids), the prefix cache's key
    cache_namespace: bytes = b""  # its extra_key and cache_salt (prefix_cache.namespace)
    harmony: harmony_answer.Prompt | None = None  # a Harmony chat prompt: answered in Harmony
    tools: tuple[tuple[str, Any], ...] = ()  # functions a structural_tag lets the model call
    json_schema: dict[str, Any] | None = None  # the constraint on the (final) answer
    top_logprobs: int | None = None  # return_logprob asked: with this many top tokens per position
    priority: int | None = None  # SGLang's request priority, as asked (None: none)


@dataclass(frozen=True, slots=True)
class OutputPlan:
    offset: int  # where in the synthetic stream this answer starts
    tokens: int  # completion_tokens if it runs to its end
    finish_reason: dict[str, Any]
    ends_with_eos: bool  # the last token is EOS: counted, never shown as text
    final_chars: int | None  # a stop string trims the final text to this many chars
    listed: Listed | None = None  # the answer written out (else a window of the synthetic stream)

    def text_and_ids(self, synth: SyntheticText, k: int) -> tuple[str, list[int]]:
        """Cumulative text and ids after `k` tokens (`k == tokens` is the final answer)."""
        visible = k - 1 if self.ends_with_eos and k == self.tokens else k
        text, ids = (self.listed or synth).window(self.offset, visible)
        if visible < k:
            ids.append(EOS_TOKEN_ID)
        if k == self.tokens and self.final_chars is not None:
            text = text[: self.final_chars]
        return text, ids

    def token_ids(self, synth: SyntheticText, n: int) -> tuple[int, ...]:
        """The answer's first `n` ids (fewer than it has: EOS, if it ends with one, is last)."""
        source = self.listed or synth
        start = self.offset % source.period
        return source.ids[start : start + n]

    def delta(self, synth: SyntheticText, since: int, k: int) -> tuple[str, list[int]]:
        """Text and ids added between `since` and `k` tokens: what an incremental stream event
        carries. Before the final token it is a plain window, O(k - since) per event; the final
        one may hide EOS and trim a stop string, so it is cut from the whole answer."""
        if k < self.tokens:
            return (self.listed or synth).window(self.offset + since, k - since)
        text, ids = self.text_and_ids(synth, k)
        if since:
            return text[len(self.text_and_ids(synth, since)[0]) :], ids[since:]
        return text, ids


def plan_output(spec: GenerateSpec, synth: SyntheticText, mean_output_tokens: float) -> OutputPlan:
    limit = spec.max_new_tokens
    listed = None if spec.ignore_eos else _written_out(spec, synth, mean_output_tokens)
    source: SyntheticText | Listed
    if listed is not None:
        source, offset = listed, spec.harmony.written if spec.harmony else 0
        left = len(listed.ids) - offset
        if left > limit:
            tokens_, finish, eos = limit, {"type": "length", "length": limit}, False
        else:
            tokens_, finish, eos = max(left, 1), {"type": "stop", "matched": listed.ids[-1]}, False
    else:
        rng = random.Random(spec.seed) if spec.seed is not None else random.Random()
        source, offset = synth, rng.randrange(synth.period)
        natural = _natural_length(rng, mean_output_tokens)
        if spec.ignore_eos or natural > limit:
            tokens_, finish, eos = limit, {"type": "length", "length": limit}, False
        else:
            natural = max(natural, spec.min_new_tokens, 1)
            tokens_, finish, eos = natural, {"type": "stop", "matched": EOS_TOKEN_ID}, True
    final_chars = None
    body_tokens = tokens_ - 1 if eos else tokens_
    if spec.stop_token_ids and body_tokens > spec.min_new_tokens:
        ids = source.window(offset, body_tokens)[1]
        stops = set(spec.stop_token_ids)
        hit = next((i for i in range(spec.min_new_tokens, body_tokens) if ids[i] in stops), None)
        if hit is not None:
            tokens_, finish, eos = hit + 1, {"type": "stop", "matched": ids[hit]}, False
            body_tokens = tokens_
    if spec.stop and body_tokens:
        text = source.window(offset, body_tokens)[0]
        best: tuple[int, str] | None = None
        for stop in spec.stop:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            needed = source.tokens_covering(offset, at + len(stop))
            if needed >= spec.min_new_tokens:
                tokens_, finish, eos = needed, {"type": "stop", "matched": stop}, False
                final_chars = None if spec.no_stop_trim else at
    return OutputPlan(offset, tokens_, finish, eos, final_chars, listed)


def _written_out(spec: GenerateSpec, synth: SyntheticText, mean_output_tokens: float) -> Listed | None:
    """The whole answer, when it is not a window of the synthetic stream: a Harmony chat's
    (drawn from the conversation, so a resumed request continues the same answer), or a
    document under `json_schema`."""
    if spec.harmony is not None:
        rng = harmony_answer.rng_for(spec.harmony, spec.seed)
        answer = harmony_answer.plan(
            spec.harmony,
            rng=rng,
            synth=synth,
            natural_tokens=_natural_length(rng, mean_output_tokens),
            tools=list(spec.tools),
            json_schema=spec.json_schema,
        )
        return answer if len(answer.ids) > spec.harmony.written else None  # else: the model goes on
    if spec.json_schema is not None:
        return harmony_answer.constrained_json(spec.json_schema, spec.seed)
    return None


def _natural_length(rng: random.Random, mean: float) -> int:
    """Where the model would emit EOS: log-normal with the given mean."""
    mu = math.log(mean) - OUTPUT_LENGTH_SIGMA**2 / 2.0
    return max(1, round(rng.lognormvariate(mu, OUTPUT_LENGTH_SIGMA)))
