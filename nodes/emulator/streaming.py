"""When a streaming request's events go out, and writing them without a task switch each.

SGLang's scheduler outputs a streaming request after a step when it finished, or when its
token count hits an output point: every count with `stream_interval` 1, else counts
1, N+1, 2N+1, ... (`len(output_ids) % N == 1`). The interval is the server's
`--stream-interval` unless the request's `sampling_params.stream_interval` sets one.

Why events are written from the engine's step callbacks: at real speed one GPU streams ~11,000
events/s, and resuming a handler task per event (future, task step, the handler's await chain,
aiohttp's writer) cost far more CPU per event than writing it from the step, where much of what
is left is the kernel's write (measured at speed 1 with a full MI355X batch; the cost per event:
docs/EMULATOR.md). So a stream asks the engine to call it at the step of its next point, and the
call encodes the event and queues it on the server's `Outbox`; the handler's task wakes only to
start the stream and to send the final event after the finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from aiohttp import hdrs, web

from nodes.emulator.worker import Generation

log = structlog.get_logger("emulator")

# Above asyncio's default high-water mark a write would wait for the client to drain. Then the
# event is held back and the next one carries its tokens too, as SGLang's tokenizer manager
# merges outputs that queued while the HTTP writer was blocked.
WRITE_BACKLOG_BYTES = 64 * 1024

# (since, k) -> the SSE bytes of an event carrying tokens since..k, or None if nothing to send.
Encode = Callable[[int, int], bytes | None]


class Outbox:
    """Stream events queued during one engine step, written back to back right after it.

    Why: a write wakes the reading client unless it is still busy with the previous ones;
    a step's ~1,000 writes in one tight burst, rather than spread between encodings, took
    less kernel time per event and less CPU in the client (measured at speed 1, full batch).
    """

    def __init__(self) -> None:
        self._queue: list[tuple[asyncio.Transport, bytes]] = []

    def put(self, transport: asyncio.Transport, data: bytes) -> None:
        if not self._queue:  # the first of a step: flush once its callbacks are done
            asyncio.get_running_loop().call_soon(self._flush)
        self._queue.append((transport, data))

    def _flush(self) -> None:
        queue, self._queue = self._queue, []
        for transport, data in queue:
            if not transport.is_closing():
                transport.write(data)


OUTBOX_KEY = web.AppKey("outbox", Outbox)


def output_point(tokens: int, interval: int) -> int:
    """The latest count, up to `tokens`, after which SGLang outputs a streaming request."""
    if interval == 1 or tokens < 1:
        return tokens
    return tokens - (tokens - 1) % interval


def next_output_point(tokens: int, interval: int) -> int:
    """The first output point after `tokens`."""
    if interval == 1 or tokens < 1:
        return tokens + 1
    return output_point(tokens, interval) + interval


class EventStream:
    """The events of one generation before its finish, written as its output points are reached."""

    def __init__(self, gen: Generation, request: web.Request, response: web.StreamResponse, encode: Encode) -> None:
        self.sent = 0  # tokens the client has been sent
        self._gen = gen
        self._engine = gen.worker.engine
        self._interval = gen.stream_interval
        self._transport = request.transport  # a closed one stays closed: `is_closing()`
        self._outbox = request.app[OUTBOX_KEY]
        # Prepared, so the headers are out and say how the body is framed (chunked on HTTP/1.1).
        self._chunked = response.headers.get(hdrs.TRANSFER_ENCODING) == "chunked"
        self._encode = encode

    async def run(self) -> int:
        """Stream until the request ends; the token count the client has by then."""
        self._on_step()
        await self._gen.ended()
        return self.sent

    def _on_step(self) -> None:
        """Called by the engine: send what is due, then ask to be called at the next point."""
        seq = self._gen.seq
        if seq.done.done():
            return  # the handler sends the final event
        try:
            # The last token goes out with the finish, in the handler's final event.
            point = output_point(min(self._engine.generated_tokens(seq), seq.target_tokens - 1), self._interval)
            if point > self.sent and not self._write(point):
                return
            self._engine.call_at_tokens(seq, next_output_point(point, self._interval), self._on_step)
        except Exception:
            # Inside the engine's step: a bug here must end this request, not the GPU.
            log.exception("emulator.stream_failed", rid=self._gen.spec.rid)
            self._gen.worker.abort(self._gen, "The stream failed")

    def _write(self, point: int) -> bool:
        """Send the event up to `point` unless the client is behind; False once it is gone."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return False  # the handler is being cancelled and aborts the request
        if transport.get_write_buffer_size() > WRITE_BACKLOG_BYTES:
            return True  # held back: the next event carries these tokens too
        data = self._encode(self.sent, point)
        if data is not None:
            self._outbox.put(transport, b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        self.sent = point
        return True
