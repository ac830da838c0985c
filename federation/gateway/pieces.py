"""The types the gateway's response path shares, in a module of their own so that the modules
that make them and those that say them import one way: a request's job (`jobs.py` makes it),
the chunks of its answer (`failover.py` makes them from the sites' deltas) and the items of a
Harmony answer as OpenAI's APIs show them (`responses.py` and `responses_api.py` say them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from core import wire

JobKind = Literal["chat", "completion", "generate", "responses"]


@dataclass(frozen=True, slots=True)
class Job:
    kind: JobKind
    request: wire.GenerateRequest
    max_tokens: int  # what the client asked for; 0 when it set no limit
    stream: bool
    include_usage: bool
    model: str
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every text chunk
    echo: dict[str, Any] | None = None  # /v1/responses: the request's fields its Response says back
    service_tier: str | None = None  # as asked ("auto", a tier's name, or None); request.tier is the one used


class Chunk(NamedTuple):
    """A piece of the answer as the client's one stream sees it: its token count continues
    across sites. (A NamedTuple: one is built per delta, at the token rate.)"""

    text: str
    output_ids: tuple[int, ...]
    completion_tokens: int
    finish_reason: dict[str, Any] | None
    site: str
    logprobs: tuple[float, ...] = ()  # asked for: one per output id
    top: tuple[tuple[tuple[int, float], ...], ...] = ()
    cached_tokens: int = 0  # of the prompt, found in prefix caches so far (every site the answer used)


@dataclass(slots=True)
class OutputItem:
    """One part of a Harmony answer as OpenAI's APIs show it: its reasoning, its text, or a
    tool call (`name`: the function; `parts`: the arguments)."""

    kind: Literal["reasoning", "content", "call"]
    id: str
    name: str = ""
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)
