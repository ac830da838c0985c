"""The load generator's HTTP/1.1 connections: kept alive between requests, as client libraries
keep them, and read in the transport's callbacks.

Why not aiohttp's client, which the bench used before: it wakes the reading task and reads a
line for every chunk of every stream. At SGLang's pace (a chunk per ~100 ms per stream, 1,536
streams) that made the load generator the largest CPU user in the data path bench, beside the
gateway and agents it measures (docs/BENCHMARKS.md, "The load generator at half the CPU"). Here
httptools (llhttp) parses the framing as the bytes arrive and hands each line of the body to the
request's reader, with no task woken per chunk (the way `nodes/agent/worker_stream.py` reads
the workers). aiohttp's session stays for the calls that are not streams (`/v1/models`).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp
import httptools

MAX_LINE_BYTES = 16 * 1024**2  # a line of a stream longer than this is a broken endpoint, not an event
MAX_ERROR_BODY_BYTES = 64 * 1024  # of a refusal's body, what is kept to say why
# An idle connection older than this may be closing at the server, and a request written on it
# would be lost with it: below uvicorn's 5-s keep-alive (SGLang's server), the shortest here.
IDLE_REUSE_S = 4.0
CONNECT_TIMEOUT_S = 60.0


class AnswerFailed(Exception):
    """Raised by a reader's `line` to end its answer with this message (an error event)."""


class Reader(Protocol):
    """What one request's answer goes to, as it arrives."""

    def head(self, status: int, headers: dict[str, str]) -> None: ...

    def line(self, line: bytes) -> None:
        """A line of a 200 answer's body, without its line end (SSE: `data: ...`, or empty).
        Raises AnswerFailed to end the answer there."""

    def refused(self, body: bytes) -> None:
        """A non-200 answer's body (its first MAX_ERROR_BODY_BYTES)."""

    def end(self, error: str | None) -> None:
        """The answer is complete (None), or it cannot be: why."""


class Session:
    """Connections to the endpoints a client process sends to. To a gateway on this machine,
    client process `part` connects from a loopback address of its own: one source address has
    ~28 k ephemeral ports for a destination, and a drill keeps 32,000 requests open."""

    def __init__(self, endpoint: str = "", part: int = 0) -> None:
        local = urlsplit(endpoint).hostname == "127.0.0.1"
        self._local_addr = (f"127.0.0.{2 + part}", 0) if local else None
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, local_addr=self._local_addr)
        self.http = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        )
        # Per endpoint, its idle connections, oldest first (a dict: removing one costs nothing).
        self._idle: defaultdict[tuple[str, int], dict[Connection, None]] = defaultdict(dict)
        self._open: set[Connection] = set()  # every connection not closed yet

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for connection in list(self._open):
            connection.abandon()
        self._idle.clear()
        await self.http.close()

    async def post(self, url: str, body: bytes, reader: Reader) -> Connection:
        """Send `body` to `url` on an idle connection, else a new one; the answer goes to `reader`.
        Raises OSError (or TimeoutError) if no connection can be made."""
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        connection = self._take_idle(key)
        if connection is None:
            loop = asyncio.get_running_loop()
            connection = Connection(self._idle[key], self._open)
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await loop.create_connection(lambda: connection, *key, local_addr=self._local_addr)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        connection.request(head.encode() + body, reader)
        return connection

    def _take_idle(self, key: tuple[str, int]) -> Connection | None:
        """The newest idle connection that may still be used; the stale ones are closed."""
        idle, now = self._idle[key], time.monotonic()
        while idle and not (oldest := next(iter(idle))).reusable(now):
            oldest.abandon()
        while idle:
            connection = idle.popitem()[0]
            if connection.reusable(now):
                return connection
            connection.abandon()
        return None


class Connection(asyncio.Protocol):
    """One kept-alive connection: a request at a time, its answer parsed as it arrives; back in
    its session's idle ones once an answer ends whole and the server keeps the connection open."""

    def __init__(self, idle: dict[Connection, None], open_connections: set[Connection]) -> None:
        self._idle = idle
        self._open = open_connections
        self._transport: asyncio.Transport | None = None
        self._reader: Reader | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._headers: dict[str, str] = {}
        self._status = 0
        self._framed = True  # the body's end is in its framing (chunks or a length), not the close
        self._partial: list[bytes] = []  # a line not ended yet, in the pieces it came in
        self._partial_bytes = 0
        self._refusal = b""
        self._idle_since = 0.0

    def reusable(self, now: float) -> bool:
        transport = self._transport
        return transport is not None and not transport.is_closing() and now - self._idle_since < IDLE_REUSE_S

    def request(self, data: bytes, reader: Reader) -> None:
        assert self._transport is not None and self._reader is None
        self._reader, self._parser = reader, httptools.HttpResponseParser(self)
        self._headers, self._status, self._framed, self._refusal = {}, 0, True, b""
        self._partial.clear()
        self._partial_bytes = 0
        self._transport.write(data)

    def abandon(self) -> None:
        """Close the connection whatever it is doing (an answer cut or given up on); its reader
        hears nothing more."""
        self._reader = None
        self._idle.pop(self, None)
        if self._transport is not None:
            self._transport.close()

    # ---- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        self._open.add(self)

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes nobody asked for: the connection is not in a state to reuse
            self.abandon()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # raised in one of the callbacks below
            self._end(_why(exc.__context__))
        except httptools.HttpParserError as exc:
            self._end(f"malformed HTTP from the endpoint: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._open.discard(self)
        if exc is None and not self._framed and self._reader is not None:
            try:
                self.on_message_complete()  # a body that runs until the close has ended whole
            except Exception as cause:  # its reader refused its last line
                self._end(_why(cause))
            return
        self._end(
            f"{type(exc).__name__}: {exc}" if exc else "the endpoint closed the connection before the answer's end"
        )

    def _end(self, error: str | None) -> None:
        """The answer is over (or the connection is: `error`); its reader is told. The connection is
        kept for the next request only if the answer ended whole and the server keeps it open."""
        reader, self._reader, parser, self._parser = self._reader, None, self._parser, None
        if error is None and reader is not None and parser is not None and parser.should_keep_alive():
            self._idle_since = time.monotonic()
            self._idle[self] = None
        else:
            self._idle.pop(self, None)
            if self._transport is not None:
                self._transport.close()
        if reader is None:
            return
        if error is not None and self._status not in (0, 200):
            reader.refused(self._refusal)  # a refusal cut short still says its status
        reader.end(error)

    # ---- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self._parser is not None and self._reader is not None
        self._status = self._parser.get_status_code()
        headers = self._headers
        self._framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
        self._reader.head(self._status, headers)

    def on_body(self, body: bytes) -> None:
        reader = self._reader
        if reader is None:
            return
        if self._status != 200:
            if len(self._refusal) < MAX_ERROR_BODY_BYTES:
                self._refusal += body[: MAX_ERROR_BODY_BYTES - len(self._refusal)]
            return
        if b"\n" not in body:  # the middle of a line: kept in pieces, not joined at every read
            self._keep_partial(body)
            return
        if self._partial:
            body = b"".join((*self._partial, body))
            self._partial.clear()
            self._partial_bytes = 0
        lines = body.split(b"\n")
        rest = lines.pop()
        for line in lines:
            reader.line(line.removesuffix(b"\r"))
        if rest:
            self._keep_partial(rest)

    def _keep_partial(self, piece: bytes) -> None:
        self._partial.append(piece)
        self._partial_bytes += len(piece)
        if self._partial_bytes > MAX_LINE_BYTES:
            raise ValueError(f"the endpoint sent a line over {MAX_LINE_BYTES} bytes")

    def on_message_complete(self) -> None:
        reader = self._reader
        if reader is not None and self._status != 200:
            reader.refused(self._refusal)
        elif reader is not None and self._partial:
            reader.line(b"".join(self._partial).removesuffix(b"\r"))  # a last line with no line end
        self._end(None)


def _why(cause: BaseException | None) -> str:
    """What a reader's or a callback's exception says of the answer."""
    return str(cause) if isinstance(cause, AnswerFailed) else f"{type(cause).__name__}: {cause}"
