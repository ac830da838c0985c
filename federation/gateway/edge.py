"""The gateway's listening socket as the public internet sees it: bounded per client address.

Two things a hostile client can do to an HTTP server without sending a single valid request:
hold connections open (idle, or trickling a header a byte at a time), and open so many that
everyone else is refused by the process's descriptor limit. The first is bounded by aiohttp's
keep-alive timer, which (from aiohttp 3.14) runs from the moment a connection opens until a
whole request head has arrived, and again between requests: `runner_options` sets it. The
second is bounded here: `EdgeSite` counts each address's open connections and answers one over
the cap with a 429 and closes it, before aiohttp reads a byte of it.

A load balancer in front makes every client one address: raise the cap (or set 0, no cap)
there, and let the balancer bound its clients.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any, cast

import orjson
from aiohttp import web

from core.errors import TooManyConnections
from federation.gateway import metrics


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    idle_timeout_s: float = 30.0  # a connection with no request under way, or a request head not yet whole
    max_connections_per_address: int = 1024  # 0: no cap
    body_timeout_s: float = 60.0  # to receive a request's body once its head is in


# aiohttp reads and drops a body left unread by an early answer (an error, a 408) before it
# closes, so the client can read the answer: for this long at most, not its default 10 s.
LINGER_S = 1.0


def runner_options(limits: EdgeLimits) -> dict[str, Any]:
    """aiohttp's keep-alive timer closes a connection that has been idle, or has not finished
    its request head, for this long; an unread body is drained for LINGER_S at most."""
    return {"keepalive_timeout": limits.idle_timeout_s, "lingering_time": LINGER_S}


def _too_many(limit: int) -> bytes:
    """A whole HTTP answer: aiohttp never sees the connection, so it is written raw."""
    error = TooManyConnections(
        f"Too many connections from your address (at most {limit}); reuse connections.", retry_after_s=1
    )
    body = orjson.dumps(error.body())
    head = (
        f"HTTP/1.1 {error.status} Too Many Requests\r\nContent-Type: application/json\r\n"
        f"Retry-After: {error.retry_after_s}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, admitted only while its address is under the cap."""

    __slots__ = ("_address", "_inner", "_limit", "_open")

    def __init__(self, inner: asyncio.Protocol, open_: Counter[str], limit: int) -> None:
        self._inner, self._open, self._limit = inner, open_, limit
        self._address: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self._limit and self._open[address] >= self._limit:
            metrics.REFUSED_CONNECTIONS.inc()
            cast(asyncio.Transport, transport).write(_too_many(self._limit))  # uvloop's is no WriteTransport subclass
            transport.close()
            return
        self._address = address
        self._open[address] += 1
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._address is None:
            return
        self._open[self._address] -= 1
        if self._open[self._address] <= 0:
            del self._open[self._address]
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._address is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._address is not None else None

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class EdgeSite(web.BaseSite):
    """A TCP site whose connections are counted per client address (see the module's doc)."""

    __slots__ = ("_host", "_max_per_address", "_port", "_reuse_port")

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, *, max_per_address: int, reuse_port: bool = False
    ) -> None:
        super().__init__(runner, backlog=4096)
        self._host, self._port, self._reuse_port = host, port, reuse_port
        self._max_per_address = max_per_address

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        handlers, limit, open_ = self._runner.server, self._max_per_address, Counter[str]()
        assert handlers is not None  # the runner is set up: BaseSite checked
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Counted(handlers(), open_, limit),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port,
        )
