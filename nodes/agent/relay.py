"""One gateway process's Generate call at this site: its generations' tokens, in few messages.

A worker sends an event per token; a gRPC message costs tens of µs at each end, so a message
per event (or per stream per window) would cost more than the GPUs' tokens are worth. Each
generation's new tokens wait in its `Relayed` record instead, and a flush sends every waiting
record's tokens as one `TokenBatch`, whatever the number of generations:

- on a tick every `coalesce_s` (AgentTimings) while tokens wait: a token waits at most that, so
  while tokens flow a client sees a chunk every `coalesce_s`, carrying every token of that tick (a token after
  a longer silence goes at once: its gap is already long);
- at once (on the loop's next turn, gathering what that turn brought) for a generation's first
  token, its end or its failure, and for every event of a generation that asked for each event
  as its own chunk (`every_event`): TTFT is never delayed by the window. Such a flush takes only
  those records, so a steady stream of first tokens does not flush everyone else early.

A write waits on gRPC's flow control when the gateway reads slowly; tokens keep gathering in
their records meanwhile, so a slow reader gets fewer, larger messages rather than a queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from core import wire

# The longest a token waits at the agent while its stream flows (`coalesce_s`, 100 ms) is the
# cadence of the chunks a client sees. At MLPerf's TPOT (~70-80 ms) a chunk then carries one or
# two tokens; the gateway's cost is per chunk (a socket write per client), so a shorter tick
# costs more CPU per token.
# One message at most this big: a flush of thousands of streams goes as several, with the loop free
# between them for new requests (gRPC's default receive limit is 4 MB).
MAX_BATCH_BYTES = 64 * 1024
DELTA_OVERHEAD_BYTES = 32  # a delta's fields besides its text and ids, roughly
ID_BYTES = 4  # a token id as a varint, roughly
NO_ERROR = wire.StreamError.NONE


class Relayed:
    """One generation's tokens since its previous delta; `event` is its worker call's sink."""

    __slots__ = (
        "_call",
        "accepted_unix_s",
        "cached_tokens",
        "completion_tokens",
        "error",
        "error_message",
        "every_event",
        "finish",
        "ids",
        "prompt_tokens",
        "sent_tokens",
        "size_bytes",
        "started",
        "stream",
        "text",
        "token_logprobs",
        "top",
        "worker",
    )

    def __init__(self, call: RelayCall, stream: int, every_event: bool) -> None:
        self._call = call
        self.stream = stream
        self.every_event = every_event
        self.accepted_unix_s = time.time()
        self.text: list[str] = []
        self.ids: list[int] = []
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of the prompt, found in the worker's prefix cache
        self.finish: dict[str, Any] | None = None
        self.worker = ""
        self.error = wire.StreamError.NONE
        self.error_message = ""
        self.token_logprobs: list[float] = []  # asked for: the new tokens'
        self.top: list[tuple[tuple[int, float], ...]] = []
        self.sent_tokens = 0  # completion tokens as of the last delta sent
        self.started = False  # its first delta was sent
        self.size_bytes = DELTA_OVERHEAD_BYTES  # of its next delta, roughly

    def event(
        self, text: str, ids: list[int], completion: int, prompt: int, finish: dict[str, Any] | None, cached: int = 0
    ) -> None:
        self.text.append(text)
        self.ids.extend(ids)
        self.size_bytes += len(text) + ID_BYTES * len(ids)
        self.completion_tokens, self.prompt_tokens, self.cached_tokens = completion, prompt, cached
        self.finish = finish
        self._call.waiting(self, urgent=self.every_event or finish is not None or not self.started)

    def logprobs(self, chosen: list[float], top: list[tuple[tuple[int, float], ...]]) -> None:
        self.token_logprobs += chosen
        self.top += top
        self.size_bytes += 4 * len(chosen) + 8 * sum(len(t) for t in top)

    def fail(self, error: wire.StreamError, message: str) -> None:
        """The generation ended without an answer's end; its last delta says why."""
        self.error, self.error_message = error, message
        self._call.waiting(self, urgent=True)

    def take(self) -> wire.TokenDelta:
        first = not self.started
        delta = wire.TokenDelta(
            self.stream,
            "".join(self.text),
            tuple(self.ids),
            self.completion_tokens,
            self.prompt_tokens,
            self.finish,
            self.worker if first else "",
            self.accepted_unix_s if first else 0.0,
            self.error,
            self.error_message,
            tuple(self.token_logprobs),
            tuple(self.top),
            self.cached_tokens,
        )
        self.text, self.ids, self.started, self.size_bytes = [], [], True, DELTA_OVERHEAD_BYTES
        if self.token_logprobs:
            self.token_logprobs, self.top = [], []
        return delta

    @property
    def flowing(self) -> bool:
        """Its next delta is only new text and ids (not its first, its last, a failure or
        logprobs): it may go in the batch's columns."""
        return self.started and self.finish is None and self.error is NO_ERROR and not self.token_logprobs

    def take_into(self, flow: wire.TokenFlow) -> None:
        """Its next delta, into `flow`'s columns (when `flowing`)."""
        text, ids = self.text, self.ids
        flow.streams.append(self.stream)
        flow.texts.append(text[0] if len(text) == 1 else "".join(text))
        flow.id_counts.append(len(ids))
        flow.ids.extend(ids)
        flow.completion_tokens.append(self.completion_tokens)
        self.text, self.ids, self.size_bytes = [], [], DELTA_OVERHEAD_BYTES


class RelayCall:
    """The sending side of one Generate call: which records wait, when they are flushed.
    `on_sent(record, tokens)` hears of the output tokens each delta carried."""

    def __init__(self, write, on_sent: Callable[[Relayed, int], None], coalesce_s: float, flow: bool = False) -> None:
        self._write = write  # the call's context.write
        self._flow = flow  # the gateway reads TokenBatch.flow
        self._on_sent = on_sent
        self._coalesce_s = coalesce_s
        self._waiting: dict[Relayed, None] = {}  # in the order they began to wait
        self._urgent: dict[Relayed, None] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing due, nothing being written
        self._idle.set()
        self._timer: asyncio.TimerHandle | None = None
        self._last_tick = 0.0  # loop time

    def waiting(self, record: Relayed, *, urgent: bool) -> None:
        self._waiting[record] = None
        if urgent:
            self._urgent[record] = None
            self._idle.clear()
            self._wake.set()
        elif self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(max(loop.time(), self._last_tick + self._coalesce_s), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._last_tick = asyncio.get_running_loop().time()
        self._urgent.update(self._waiting)  # the window is over for everyone waiting
        if self._urgent:
            self._idle.clear()
            self._wake.set()

    async def drained(self) -> None:
        """Every token waiting sent (the call is about to end)."""
        if self._timer is not None:
            self._timer.cancel()
        self._tick()
        await self._idle.wait()

    async def write_forever(self) -> None:
        """Flush whenever something is due; runs until cancelled with the call."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._urgent:
                    await self._write(wire.token_batch_to_pb(*self._take()))
                self._idle.set()
        finally:
            if self._timer is not None:
                self._timer.cancel()

    def _take(self) -> tuple[list[wire.TokenDelta], wire.TokenFlow]:
        """The due records' deltas, up to one message's worth: the middle of answers in columns
        when the gateway reads them, the others as TokenDeltas."""
        deltas, flow, size = [], wire.TokenFlow.empty(), 0
        columns = self._flow
        taken = []
        for record in self._urgent:  # in order, and past each once (popping the first of a dict
            if size >= MAX_BATCH_BYTES:  # again and again walks every slot freed before it)
                break
            taken.append(record)
            size += record.size_bytes
        for record in taken:
            del self._urgent[record]
            self._waiting.pop(record, None)
            completion = record.completion_tokens
            if columns and record.flowing:
                record.take_into(flow)
            else:
                deltas.append(record.take())
            new, record.sent_tokens = completion - record.sent_tokens, completion
            if new > 0:
                self._on_sent(record, new)
        if not self._waiting and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return deltas, flow
