"""What a request will generate, decided when it arrives, as a model's output would be.

A real model's answer length is set by where it emits EOS, by a stop string or stop
token it happens to produce, or by `max_new_tokens`. The emulator draws the EOS point
from a seeded length distribution (mean like MLPerf's gpt-oss set), then applies the
request's stops to the synthetic text, so the engine knows the exact token count it
must emulate and every finish reason has SGLang's shape.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from core import tokens
from core.tokens import SyntheticText

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


@dataclass(frozen=True, slots=True)
class OutputPlan:
    offset: int  # where in the synthetic stream this answer starts
    tokens: int  # completion_tokens if it runs to its end
    finish_reason: dict[str, Any]
    ends_with_eos: bool  # the last token is EOS: counted, never shown as text
    final_chars: int | None  # a stop string trims the final text to this many chars

    def text_and_ids(self, synth: SyntheticText, k: int) -> tuple[str, list[int]]:
        """Cumulative text and ids after `k` tokens (`k == tokens` is the final answer)."""
        visible = k - 1 if self.ends_with_eos and k == self.tokens else k
        text, ids = synth.window(self.offset, visible)
        if visible < k:
            ids.append(EOS_TOKEN_ID)
        if k == self.tokens and self.final_chars is not None:
            text = text[: self.final_chars]
        return text, ids

    def delta(self, synth: SyntheticText, since: int, k: int) -> tuple[str, list[int]]:
        """Text and ids added between `since` and `k` tokens: what an incremental stream event
        carries. Before the final token it is a plain window, O(k - since) per event; the final
        one may hide EOS and trim a stop string, so it is cut from the whole answer."""
        if k < self.tokens:
            return synth.window(self.offset + since, k - since)
        text, ids = self.text_and_ids(synth, k)
        if since:
            return text[len(self.text_and_ids(synth, since)[0]) :], ids[since:]
        return text, ids


def plan_output(spec: GenerateSpec, synth: SyntheticText, mean_output_tokens: float) -> OutputPlan:
    rng = random.Random(spec.seed) if spec.seed is not None else random.Random()
    offset = rng.randrange(synth.period)
    limit = spec.max_new_tokens
    natural = _natural_length(rng, mean_output_tokens)
    if spec.ignore_eos or natural > limit:
        tokens_, finish, eos = limit, {"type": "length", "length": limit}, False
    else:
        natural = max(natural, spec.min_new_tokens, 1)
        tokens_, finish, eos = natural, {"type": "stop", "matched": EOS_TOKEN_ID}, True
    final_chars = None
    body_tokens = tokens_ - 1 if eos else tokens_
    if spec.stop_token_ids and body_tokens > spec.min_new_tokens:
        ids = synth.window(offset, body_tokens)[1]
        stops = set(spec.stop_token_ids)
        hit = next((i for i in range(spec.min_new_tokens, body_tokens) if ids[i] in stops), None)
        if hit is not None:
            tokens_, finish, eos = hit + 1, {"type": "stop", "matched": ids[hit]}, False
            body_tokens = tokens_
    if spec.stop and body_tokens:
        text = synth.window(offset, body_tokens)[0]
        best: tuple[int, str] | None = None
        for stop in spec.stop:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            needed = synth.tokens_covering(offset, at + len(stop))
            if needed >= spec.min_new_tokens:
                tokens_, finish, eos = needed, {"type": "stop", "matched": stop}, False
                final_chars = None if spec.no_stop_trim else at
    return OutputPlan(offset, tokens_, finish, eos, final_chars)


def _natural_length(rng: random.Random, mean: float) -> int:
    """Where the model would emit EOS: log-normal with the given mean."""
    mu = math.log(mean) - OUTPUT_LENGTH_SIGMA**2 / 2.0
    return max(1, round(rng.lognormvariate(mu, OUTPUT_LENGTH_SIGMA)))
