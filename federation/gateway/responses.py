"""How an answer reaches its client: written to the client's SSE stream as its chunks arrive, or
collected into one body (what the answer says, per API, is `answers.py`'s).

Chunks arrive in the upstream reader's turn, many requests' at once. Waking each request's
handler to write its own chunk would cost a task switch per chunk per client, a large share of
the gateway's CPU per token at SGLang's pace; so a chunk's event is built at once and queued,
and one call-soon pass after the reader's turn (`WriteBatch`) writes every client that has
events waiting: one socket write per client per batch of deltas, no task woken.

Once the response has begun (aiohttp has sent its headers, with chunked transfer encoding on
HTTP/1.1), the body is written to the transport directly, framed as HTTP/1.1 chunks: aiohttp's
`write` is a coroutine, and a callback cannot await. The handler writes the end itself, through
aiohttp, after flushing what is queued.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from aiohttp import hdrs, web

from federation.gateway.answers import Answer
from federation.gateway.pieces import Chunk

log = structlog.get_logger("gateway")

# A client that stops reading: past this much unsent, its answer is cut (its connection closed,
# which cancels the generation) rather than kept in this process's memory.
MAX_CLIENT_BUFFER_BYTES = 16 * 1024**2


class WriteBatch:
    """Clients with events waiting, written in one pass as soon as the loop is free."""

    def __init__(self) -> None:
        self._clients: list[SseClient] = []
        self._scheduled = False

    def add(self, client: SseClient) -> None:
        self._clients.append(client)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._write)

    def _write(self) -> None:
        clients, self._clients, self._scheduled = self._clients, [], False
        for client in clients:
            client.flush()


class Collected:
    """A whole answer in one body: the chunks only accumulate (`headers()` says the body's
    headers once the answer is whole)."""

    def __init__(self, answer: Answer, headers: Callable[[], dict[str, str]]) -> None:
        self.answer = answer
        self.headers = headers
        self.first_chunk_at: float | None = None

    def chunk(self, chunk: Chunk) -> None:
        self.answer.add(chunk)

    def flow(self, text: str, output_ids: tuple[int, ...], completion_tokens: int, site: str) -> None:
        self.answer.add(Chunk(text, output_ids, completion_tokens, None, site))

    def constrained_output_begun(self) -> bool:
        return self.answer.constrained_output_begun()

    async def opened(self, site: str) -> None:
        self.first_chunk_at = time.monotonic()


class SseClient:
    """One client's SSE stream. `opened` sends the headers (`headers()` says them then) and what
    came so far; later chunks are written as they arrive (see the module's docstring)."""

    def __init__(
        self, request: web.Request, answer: Answer, writes: WriteBatch, headers: Callable[[], dict[str, str]]
    ) -> None:
        self._request = request
        self.answer = answer
        self._writes = writes
        self.headers = headers
        self._started = time.monotonic()
        self.first_chunk_at: float | None = None
        self.response: web.StreamResponse | None = None
        self._transport: asyncio.Transport | None = None  # set once the headers went
        self._chunked = False
        self._pending: list[bytes] = []
        self._queued = False

    def chunk(self, chunk: Chunk) -> None:
        answer = self.answer
        answer.add(chunk)
        self._queue(answer.chunk_events(chunk, self._started))

    def flow(self, text: str, output_ids: tuple[int, ...], completion_tokens: int, site: str) -> None:
        self._queue(self.answer.flowed(text, output_ids, completion_tokens, site, self._started))

    def _queue(self, data: bytes) -> None:
        """`data` to be written in the next pass (nothing is written before the headers went)."""
        if data:
            self._pending.append(data)
            if not self._queued and self._transport is not None:
                self._queued = True
                self._writes.add(self)

    def constrained_output_begun(self) -> bool:
        return self.answer.constrained_output_begun()

    async def opened(self, site: str) -> None:
        self.first_chunk_at = time.monotonic()
        response = web.StreamResponse(
            headers={**self.headers(), "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(self._request)  # sends the headers
        self.response = response
        self._chunked = response.headers.get(hdrs.TRANSFER_ENCODING) == "chunked"
        self._transport = self._request.transport
        self._pending.insert(0, self.answer.opening_events())
        self.flush()

    def flush(self) -> None:
        """Write what is queued; a client gone or too slow to read gets nothing more."""
        self._queued = False
        transport = self._transport
        if not self._pending or transport is None or transport.is_closing():
            return
        data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        if not data:
            return
        if transport.get_write_buffer_size() > MAX_CLIENT_BUFFER_BYTES:
            log.warning("client.too_slow", unsent_bytes=transport.get_write_buffer_size())
            transport.close()  # the handler is cancelled, and with it the generation
            return
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    async def end(self, events: bytes) -> web.StreamResponse:
        """The last events and [DONE], after everything queued; the response is complete."""
        assert self.response is not None
        self.flush()
        if self._transport is None or self._transport.is_closing():
            return self.response  # the client left after its last chunk: nobody to tell
        await self.response.write(events + b"data: [DONE]\n\n")
        return self.response
