"""A request inside an emulated GPU (`Sequence`), and who hears its milestones (`EngineListener`)."""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from nodes.emulator.radix_cache import Lock
from nodes.emulator.stretch import KvShape, Stretch

# Where kv_pools counts a sequence's KV (Sequence.kv_group).
OUT, PREFILLING, RUNNING, HELD = 0, 1, 2, 3


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """A request inside the engine. `target_tokens` is decided up front by the caller
    (length limit, stop string or EOS position), as a real model's output would be; so are its
    token ids (`ids`, the prompt's; `output_ids(n)`, the answer's first n), which the prefix cache
    keys on."""

    rid: str
    prompt_tokens: int
    target_tokens: int
    max_new_tokens: int
    arrived_at: float  # when the request reached the server (TTFT counts from here)
    queued_at: float = 0.0  # when it entered this engine's waiting queue
    queue_entry_at: float = 0.0  # when it last entered it (a retraction puts it back): priority's fcfs order
    priority: int = 0  # SGLang's request priority, as the queue sorts it (priority scheduling only)
    streaming: bool = False  # only for metrics labels (SGLang's is_streaming)
    ids: bytes = b""  # the prompt's token ids (radix_cache.pack_ids); empty: not cached
    namespace: bytes = b""  # extra_key and cache_salt: requests share cache only within one
    output_ids: Callable[[int], bytes] | None = None
    state: SeqState = SeqState.WAITING
    generated: int = 0  # tokens emitted before `join_step` (banked)
    join_step: int = 0
    prefill_left: int = 0
    chunk: int = 0  # prompt tokens the step being run prefills for it
    cached_tokens: int = 0  # SGLang's meta_info cached_tokens: the hit at its first admission
    matched: int = 0  # its hit at the last match (SGLang's num_matched_prefix_tokens)
    hit: int = 0  # tokens its current admission took from the cache
    kv_len: int = 0  # tokens with KV while prefilling or ended (running: its ΣL share instead)
    kv_prot: int = 0  # of its tokens, those the cache holds for it (SGLang's cache_protected_len)
    kv_group: int = OUT  # where kv_pools counts it
    cache_lock: Lock | None = None
    branch: int | None = None  # SGLang's swa_branching_seqlen
    swa_cursor: int = 0  # SGLang's SWA evicted_seqlen: its own SWA KV below this is freed
    decode_from: int = 0  # the first position its decode writes
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    abort_message: str | None = None
    aborted_tokens: int = 0  # what the client had when the abort came
    aborted_waiting: bool = False  # in the waiting queue then: never admitted, or retracted back to it
    finish_step: int = 0
    retractions: int = 0
    first_token: asyncio.Future[None] = field(default_factory=lambda: _new_future())
    done: asyncio.Future[None] = field(default_factory=lambda: _new_future())
    wake: Callable[[], None] | None = None  # a streaming client's call for `wake_tokens`
    wake_tokens: int = 0
    wake_step: float = math.inf  # the step it is filed under (inf: not filed, not running)


def _new_future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


class EngineListener(Protocol):
    """Receives request milestones (the metrics collector implements it)."""

    def on_first_token(self, seq: Sequence) -> None: ...

    def on_finish(self, seq: Sequence) -> None: ...

    def on_stretch(self, stretch: Stretch) -> None:
        """A stretch has run all its `k_max` steps (called before their effects are applied)."""

    def on_idle(self, kv: KvShape, at: float) -> None:
        """The engine is idle from `at` (or was idle, and its pools changed then), its pools so."""
