"""A user-space TCP proxy that behaves like a WAN link between two regions.

tc netem is unavailable on our machines, so benchmarks and drills put one of these between a
client and a region instead: every byte arrives one one-way delay (rtt_ms / 2) after it was sent,
in order, in each direction, and `cut()` / `blackhole()` / `heal()` emulate a partition: one that
resets connections (a crashed or unreachable peer) or one that drops every byte silently.

Each direction is a delay line: the reading side stamps every chunk with `read time + delay` and
queues it; the writing side sleeps until that due time and writes. A burst of chunks therefore
arrives as a burst one delay later, instead of each chunk waiting behind the delay of the one
before it. The proxy never parses the bytes, so HTTP/1.1, HTTP/2 (gRPC) and anything else over
TCP pass unchanged.

Not emulated: bandwidth limits, loss and jitter; and connection setup is not delayed (the client's
`connect()` completes at loopback speed, only the bytes that follow are delayed).

Example: `python -m federation.linkproxy --listen 127.0.0.1:7001 --target 127.0.0.1:30000 --rtt-ms 130`
prints one JSON `ready` line on stdout when listening and stops cleanly on SIGTERM or SIGINT.
SIGUSR1 cuts every link it carries, SIGRTMIN blackholes them (connections stay open, nothing
arrives either way) and SIGUSR2 heals them: how drills partition a site or a scheduler.
Repeat `--listen`/`--target` to carry several links with the same RTT in one process (the n-th
`--listen` leads to the n-th `--target`): a router that dials 16 workers across the WAN needs one
proxy process, not 16.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import resource
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import structlog

from core import runtime

log = structlog.get_logger("linkproxy")

READ_SIZE_BYTES = 64 * 1024  # large reads keep CPU per MB low
# Bytes one direction may hold between reading and writing. At 65 ms one-way this still allows
# ~60 MB/s per connection (more than one TCP stream gets over a real WAN) and bounds memory when
# the far side stops reading: past it we stop reading, and TCP pushes back on the sender.
MAX_IN_FLIGHT_BYTES = 4 * 1024 * 1024
BLACKHOLE_SIGNAL = signal.SIGRTMIN  # drills send it to drop a link's packets (SIGUSR1 resets them)
CONNECT_TIMEOUT_S = 10.0  # a target that has not accepted in 10 s is down; the client gets a reset
# uvloop's timers count whole milliseconds and may fire up to one early; a delay line that woke
# early sleeps at least this long again, so a chunk is never early and at most ~1 ms late.
TIMER_RESOLUTION_S = 0.001
CLOSE_TIMEOUT_S = 5.0  # a peer that won't take the last bytes in 5 s gets a reset instead
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN


@dataclass(frozen=True, slots=True)
class Link:
    listen_host: str
    listen_port: int  # 0 picks a free port; LinkProxy.port tells which
    target_host: str
    target_port: int
    rtt_ms: float  # each direction is delayed by half of it

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rtt_ms) and self.rtt_ms >= 0):
            raise ValueError(f"rtt_ms must be a finite number >= 0, got {self.rtt_ms}")

    @property
    def one_way_delay_s(self) -> float:
        return self.rtt_ms / 2000.0


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST, as a partition or a crashed peer looks to the other end."""
    # The socket may be gone already (uvloop then reports a negative file descriptor).
    with contextlib.suppress(OSError, ValueError):
        sock = writer.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    writer.transport.abort()


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close with FIN after the buffered bytes are out; reset a peer that won't take them."""
    writer.close()
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await writer.wait_closed()
    except (OSError, TimeoutError):
        _reset(writer)


@dataclass(slots=True, eq=False)
class _Connection:
    """One client connection and, once connected, its connection to the target."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    task: asyncio.Task[None] | None = None
    outcome: str = "error"  # what the closing log line says; set before the task ends
    bytes_up: int = 0
    bytes_down: int = 0

    def reset(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                _reset(writer)


class _DelayLine:
    """One direction: bytes read at t are written at t + delay_s, in order, EOF included."""

    __slots__ = ("_dropping", "_queue", "_queued_bytes", "_room", "carried_bytes", "delay_s", "reader", "writer")

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        delay_s: float,
        dropping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.delay_s = delay_s
        self._dropping = dropping  # True while the link is blackholed: what is read vanishes
        self.carried_bytes = 0
        self._queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()  # (due time, chunk)
        self._queued_bytes = 0
        self._room = asyncio.Event()  # set while the line has room for another read
        self._room.set()

    async def receive(self) -> None:
        while True:
            await self._room.wait()  # backpressure: stop reading while the far side lags
            data = await self.reader.read(READ_SIZE_BYTES)
            if self._dropping():
                if not data:
                    return  # a blackhole drops the FIN too: the far side never hears of it
                continue
            self._queue.put_nowait((time.monotonic() + self.delay_s, data))
            if not data:  # EOF travels down the line like any chunk
                return
            self._queued_bytes += len(data)
            if self._queued_bytes >= MAX_IN_FLIGHT_BYTES:
                self._room.clear()

    async def deliver(self) -> None:
        while True:
            due, data = await self._queue.get()
            # A deadline, not a condition another task sets (no Event to wait on); the timer may
            # fire early, so the clock is read again: a chunk is never delivered early.
            while (wait_s := due - time.monotonic()) > 0:  # noqa: ASYNC110
                await asyncio.sleep(max(wait_s, TIMER_RESOLUTION_S))
            if not data:
                if self.writer.can_write_eof() and not self.writer.transport.is_closing():
                    self.writer.write_eof()  # half-close: the peer may still answer
                return
            self.writer.write(data)
            await self.writer.drain()
            self.carried_bytes += len(data)
            self._queued_bytes -= len(data)
            if self._queued_bytes < MAX_IN_FLIGHT_BYTES:
                self._room.set()


class LinkProxy:
    """Listens on `link.listen_*` and carries every connection to `link.target_*` with delay."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._cut = False
        self._dropping = False  # blackholed: connections stay open, every byte is dropped
        self._stopping = False
        self._log = log.bind(
            listen=f"{link.listen_host}:{link.listen_port}",
            target=f"{link.target_host}:{link.target_port}",
            rtt_ms=link.rtt_ms,
        )

    @property
    def port(self) -> int:
        """The bound port (differs from `link.listen_port` when that is 0)."""
        if self._port is None:
            raise RuntimeError("LinkProxy.port is known only after start()")
        return self._port

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed, including any still connecting to the target."""
        return len(self._connections)

    async def start(self) -> None:
        self._stopping = False
        self._server = await asyncio.start_server(
            self._accept, self.link.listen_host, self.link.listen_port, limit=READ_SIZE_BYTES
        )
        # With port 0 and a name that resolves to several addresses each socket gets its own
        # port; the first one is the one we report.
        self._port = self._server.sockets[0].getsockname()[1]
        self._log = self._log.bind(listen=f"{self.link.listen_host}:{self._port}")
        self._log.info("link.listening")

    async def stop(self) -> None:
        """Close the listener and reset every connection; return once all their tasks ended."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        self._reset_all("stopped")
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
            self._log.info("link.stopped")

    def cut(self) -> None:
        """Partition: reset every open connection now, and each new one until `heal()`."""
        self._cut = True
        self._log.warning("link.cut", reset_connections=len(self._connections))
        self._reset_all("cut")

    def blackhole(self) -> None:
        """Partition that drops packets instead of refusing them: every open connection and
        each new one stays open, and nothing arrives in either direction until `heal()`."""
        self._dropping = True
        self._log.warning("link.blackholed", open_connections=len(self._connections))

    def heal(self) -> None:
        if self._dropping:  # the bytes dropped broke every stream that was open: end them
            self._reset_all("blackholed")
        self._cut = self._dropping = False
        self._log.info("link.healed")

    async def __aenter__(self) -> LinkProxy:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def _is_dropping(self) -> bool:
        return self._dropping

    def _reset_all(self, outcome: str) -> None:
        for conn in self._connections:
            conn.outcome = outcome
            conn.reset()
            if conn.task is not None:
                conn.task.cancel()
        self._connections.clear()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Called by the server for each new client; a plain callback so we own the task."""
        conn = _Connection(client=writer)
        if self._cut or self._stopping:
            # Accept-then-reset: the closest a user-space proxy gets to a dropped SYN.
            conn.reset()
            self._log.info("link.connection_refused", reason="cut" if self._cut else "stopping")
            return
        self._connections.add(conn)
        conn.task = asyncio.create_task(self._serve(conn, reader), name="linkproxy.connection")
        self._tasks.add(conn.task)
        conn.task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.error("link.connection_crashed", exc_info=task.exception())

    async def _serve(self, conn: _Connection, client_reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        peer = conn.client.get_extra_info("peername")
        clog = self._log.bind(peer=f"{peer[0]}:{peer[1]}" if peer else None)
        try:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    upstream_reader, conn.upstream = await asyncio.open_connection(
                        self.link.target_host, self.link.target_port, limit=READ_SIZE_BYTES
                    )
            except (OSError, TimeoutError) as exc:
                conn.outcome = "target_unreachable"
                clog.warning("link.target_unreachable", error=repr(exc))
                return
            clog.debug("link.connection_opened")
            delay_s = self.link.one_way_delay_s
            dropping = self._is_dropping
            up = _DelayLine(client_reader, conn.upstream, delay_s, dropping)
            down = _DelayLine(upstream_reader, conn.client, delay_s, dropping)
            try:
                async with asyncio.TaskGroup() as tg:
                    for line in (up, down):
                        tg.create_task(line.receive())
                        tg.create_task(line.deliver())
                conn.outcome = "closed"  # both sides sent EOF and both EOFs were delivered
            except* OSError as group:  # a reset or a broken pipe on either side ends both
                conn.outcome = "error"
                clog = clog.bind(error=repr(group.exceptions[0]))
            finally:
                conn.bytes_up, conn.bytes_down = up.carried_bytes, down.carried_bytes
        finally:
            try:
                if conn.outcome == "closed":
                    await asyncio.gather(*(_close(w) for w in (conn.client, conn.upstream) if w is not None))
                else:
                    conn.reset()
            finally:
                self._connections.discard(conn)
                clog.info(
                    "link.connection_closed",
                    outcome=conn.outcome,
                    bytes_up=conn.bytes_up,
                    bytes_down=conn.bytes_down,
                    duration_ms=round((loop.time() - started) * 1000.0, 1),
                )


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be a number, got {port!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {number}")
    return host.removeprefix("[").removesuffix("]"), number


def _rtt_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m federation.linkproxy",
        description="TCP proxy that delays each direction by rtt/2, like a WAN link between regions.",
    )
    p.add_argument(
        "--listen",
        type=_host_port,
        action="append",
        required=True,
        help="HOST:PORT to accept on (port 0: any); repeat for several links",
    )
    p.add_argument(
        "--target", type=_host_port, action="append", required=True, help="HOST:PORT to forward to, one per --listen"
    )
    p.add_argument("--rtt-ms", type=_rtt_ms, required=True, help="round-trip time to add, in ms")
    args = p.parse_args(argv)
    if len(args.listen) != len(args.target):
        p.error(f"give one --target per --listen (got {len(args.listen)} --listen, {len(args.target)} --target)")
    if any(port == 0 for _, port in args.target):
        p.error("--target needs a port > 0")
    return args


def raise_open_files_limit() -> None:
    """Each carried connection holds two descriptors: one process carrying a router's ~9 k streams
    to a site's workers needs ~18 k, past the 1,024 many machines allow by default."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def serve(args: argparse.Namespace) -> int:
    stop = runtime.stop_event()
    proxies = [
        LinkProxy(Link(listen_host, listen_port, target_host, target_port, args.rtt_ms))
        for (listen_host, listen_port), (target_host, target_port) in zip(args.listen, args.target, strict=True)
    ]
    started: list[LinkProxy] = []
    for proxy in proxies:
        try:
            await proxy.start()
        except OSError as exc:
            log.error("link.bind_failed", listen=_join(proxy.link.listen_host, proxy.link.listen_port), error=str(exc))
            await asyncio.gather(*(p.stop() for p in started))
            return 1
        started.append(proxy)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: [p.cut() for p in proxies])
    loop.add_signal_handler(signal.SIGUSR2, lambda: [p.heal() for p in proxies])
    loop.add_signal_handler(BLACKHOLE_SIGNAL, lambda: [p.blackhole() for p in proxies])
    links = [
        {"listen": _join(p.link.listen_host, p.port), "target": _join(p.link.target_host, p.link.target_port)}
        for p in proxies
    ]
    # One link: the line it always had; several: all of them, in the order given.
    runtime.announce_ready(**(links[0] if len(links) == 1 else {"links": links}), rtt_ms=args.rtt_ms)
    await stop.wait()
    await asyncio.gather(*(p.stop() for p in proxies))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_open_files_limit()
    return runtime.run(serve, args)


if __name__ == "__main__":
    sys.exit(main())
