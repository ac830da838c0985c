"""The WAN-link proxy: delay per direction, integrity, partitions, clean stop, gRPC, CLI."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc
import pytest

from federation.linkproxy import Link, LinkProxy

ROOT = Path(__file__).resolve().parents[1]
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class _Echo(asyncio.Protocol):
    """Echoes bytes back and closes after the client's EOF; a protocol, so it runs no tasks."""

    def __init__(self, ended: asyncio.Queue[BaseException | None]) -> None:
        self.ended = ended
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def eof_received(self) -> bool:
        return False  # close once every echoed byte is out

    def connection_lost(self, exc: BaseException | None) -> None:
        self.ended.put_nowait(exc)


@dataclass(frozen=True, slots=True)
class EchoServer:
    port: int
    ended: asyncio.Queue[BaseException | None]  # how each connection ended: None or the error


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    ended: asyncio.Queue[BaseException | None] = asyncio.Queue()
    server = await asyncio.get_running_loop().create_server(lambda: _Echo(ended), "127.0.0.1", 0)
    try:
        yield EchoServer(server.sockets[0].getsockname()[1], ended)
    finally:
        server.close()
        await server.wait_closed()


def link_to(port: int, rtt_ms: float) -> Link:
    return Link("127.0.0.1", 0, "127.0.0.1", port, rtt_ms)


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[Stream]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.transport.abort()


async def round_trip(stream: Stream, payload: bytes = b"ping") -> float:
    reader, writer = stream
    started = time.perf_counter()
    writer.write(payload)
    await writer.drain()
    async with asyncio.timeout(5):
        assert payload == await reader.readexactly(len(payload))
    return time.perf_counter() - started


async def round_trips(port: int, n: int) -> list[float]:
    async with connect(port) as stream:
        return [await round_trip(stream) for _ in range(n)]


async def test_round_trip_takes_the_rtt(echo: EchoServer) -> None:
    """Every round trip through a 100 ms link takes at least 100 ms and less than a direct round
    trip to the same server plus 300 ms."""
    async with LinkProxy(link_to(echo.port, 100)) as proxy:
        direct = await round_trips(echo.port, 5)
        linked = await round_trips(proxy.port, 5)
    assert min(linked) >= 0.100
    assert max(linked) < max(direct) + 0.300


async def test_a_burst_is_delayed_once_not_per_chunk(echo: EchoServer) -> None:
    """Ten chunks sent 10 ms apart all come back about one RTT after they left; a proxy that
    delayed each chunk behind the previous one would need 0.5 s more for the last."""
    async with LinkProxy(link_to(echo.port, 100)) as proxy, connect(proxy.port) as (reader, writer):
        for _ in range(10):
            writer.write(b"x" * 100)
            await writer.drain()
            last_sent = time.perf_counter()
            await asyncio.sleep(0.010)
        async with asyncio.timeout(5):
            await reader.readexactly(1000)
        after_last = time.perf_counter() - last_sent
    assert 0.100 <= after_last < 0.300


async def test_5_mb_pass_intact_both_ways(echo: EchoServer) -> None:
    """5 MB sent through a 20 ms link come back from the echo server byte for byte, and the
    client's EOF reaches the server and the server's EOF reaches the client (half-close)."""
    payload = os.urandom(5 * 1024 * 1024)
    async with LinkProxy(link_to(echo.port, 20)) as proxy, connect(proxy.port) as (reader, writer):

        async def send() -> None:
            for i in range(0, len(payload), 256 * 1024):
                writer.write(payload[i : i + 256 * 1024])
                await writer.drain()
            writer.write_eof()  # the echo server closes after this; we still read its answer

        async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
            tg.create_task(send())
            received = tg.create_task(reader.read())  # to EOF
    assert hashlib.sha256(payload).hexdigest() == hashlib.sha256(received.result()).hexdigest()
    assert await asyncio.wait_for(echo.ended.get(), 5) is None  # the target saw a clean close


async def test_a_stalled_target_pushes_back_on_the_sender() -> None:
    """When the target stops reading, the proxy stops reading from the client once its buffers
    are full, so the client's drain() blocks instead of the proxy buffering without bound."""
    sent = 0

    async def send(writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        chunk = bytes(64 * 1024)
        while True:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)

    # A listening socket nobody accepts from: the kernel takes the connection and buffers a
    # little, then the peer's window is shut, like a target stuck in a long pause.
    with socket.create_server(("127.0.0.1", 0)) as stalled:
        async with LinkProxy(link_to(stalled.getsockname()[1], 10)) as proxy:
            async with connect(proxy.port) as (_, writer), asyncio.TaskGroup() as tg:
                sender = tg.create_task(send(writer))
                await asyncio.sleep(0.5)  # long enough to fill every buffer on the way
                filled = sent
                await asyncio.sleep(0.5)
                sender.cancel()
    assert filled > 0
    assert sent - filled <= 1024 * 1024, (filled, sent)


async def test_cut_resets_connections_until_heal(echo: EchoServer) -> None:
    """cut() resets an open connection at both ends and resets each new one; after heal() a new
    connection works again."""
    async with LinkProxy(link_to(echo.port, 10)) as proxy:
        async with connect(proxy.port) as stream:
            await round_trip(stream)
            assert proxy.open_connections == 1
            proxy.cut()
            assert proxy.open_connections == 0
            with pytest.raises(ConnectionResetError):
                async with asyncio.timeout(5):
                    await stream[0].read(1)
        assert isinstance(await asyncio.wait_for(echo.ended.get(), 5), ConnectionResetError)

        async with connect(proxy.port) as stream:  # the kernel accepts; the proxy resets
            with pytest.raises(ConnectionError):
                await round_trip(stream)
        assert proxy.open_connections == 0

        proxy.heal()
        async with connect(proxy.port) as stream:
            await round_trip(stream)


async def test_blackhole_drops_every_byte_and_keeps_connections_open(echo: EchoServer) -> None:
    """blackhole(): an open connection stays open but nothing crosses it either way, a new one
    is accepted and hears nothing back; heal() ends the connections whose bytes were dropped and
    new ones work again. (A dropped packet, not a reset: what keepalive pings must find.)"""
    async with LinkProxy(link_to(echo.port, 10)) as proxy:
        async with connect(proxy.port) as old:
            await round_trip(old)
            proxy.blackhole()
            old[1].write(b"lost")
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await old[0].read(1)
            assert proxy.open_connections == 1 and echo.ended.empty()
            async with connect(proxy.port) as new:
                new[1].write(b"lost too")
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await new[0].read(1)
            proxy.heal()
            with pytest.raises(ConnectionResetError):
                async with asyncio.timeout(5):
                    await old[0].read(1)
        async with connect(proxy.port) as stream:
            await round_trip(stream)


async def test_stop_leaves_nothing_behind(echo: EchoServer) -> None:
    """stop() resets every connection, even with bytes still on the line, closes the listener,
    and returns only after all of the proxy's tasks have ended."""
    before = asyncio.all_tasks()
    proxy = LinkProxy(link_to(echo.port, 200))
    await proxy.start()
    async with contextlib.AsyncExitStack() as stack:
        streams = [await stack.enter_async_context(connect(proxy.port)) for _ in range(3)]
        await asyncio.gather(*(round_trip(stream) for stream in streams))  # all three are carried
        assert proxy.open_connections == 3
        for _, writer in streams:
            writer.write(b"still on the line")
            await writer.drain()
        await asyncio.sleep(0.05)  # the bytes are read and wait in the delay line

        async with asyncio.timeout(5):
            await proxy.stop()

        assert proxy.open_connections == 0
        assert set() == asyncio.all_tasks() - before
        for reader, _ in streams:
            with pytest.raises(ConnectionResetError):
                async with asyncio.timeout(5):
                    await reader.read(1)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", proxy.port)


async def test_grpc_calls_pass_unchanged() -> None:
    """A unary call and a 50-message server stream over HTTP/2 (gRPC) through a 20 ms link
    return exactly what the server sent."""

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request[::-1]

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield i.to_bytes(4, "big") * 1000

    server = grpc.aio.server()
    handlers = {
        "Reverse": grpc.unary_unary_rpc_method_handler(unary),
        "Count": grpc.unary_stream_rpc_method_handler(stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Link", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with (
            LinkProxy(link_to(port, 20)) as proxy,
            grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}", options=[("grpc.enable_http_proxy", 0)]) as channel,
        ):
            assert b"olleh" == await channel.unary_unary("/test.Link/Reverse")(b"hello", timeout=10)
            call = channel.unary_stream("/test.Link/Count")(b"50", timeout=10)
            assert [i.to_bytes(4, "big") * 1000 for i in range(50)] == [m async for m in call]
    finally:
        await server.stop(None)


def start_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "federation.linkproxy", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_cli_prints_ready_forwards_and_stops_on_sigterm(echo: EchoServer) -> None:
    """`python -m federation.linkproxy` prints one JSON ready line with the bound port, carries a
    round trip with the delay, and exits 0 on SIGTERM with a connection still open."""
    proc = start_cli("--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{echo.port}", "--rtt-ms", "40")
    try:
        assert proc.stdout is not None and proc.stderr is not None
        ready = json.loads(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30))
        _, port = ready.pop("listen").rsplit(":", 1)
        assert {"event": "ready", "target": f"127.0.0.1:{echo.port}", "rtt_ms": 40.0} == ready
        async with connect(int(port)) as stream:
            assert await round_trip(stream) >= 0.040
            proc.send_signal(signal.SIGTERM)
            assert 0 == await asyncio.to_thread(proc.wait, 15)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_cli_carries_several_links_in_one_process(echo: EchoServer) -> None:
    """Repeated --listen/--target pairs: one process, one ready line listing every link in order,
    and the n-th listening port leads to the n-th target with the delay."""
    other_ended: asyncio.Queue[BaseException | None] = asyncio.Queue()
    other = await asyncio.get_running_loop().create_server(lambda: _Echo(other_ended), "127.0.0.1", 0)
    targets = [EchoServer(echo.port, echo.ended), EchoServer(other.sockets[0].getsockname()[1], other_ended)]
    proc = start_cli(
        *("--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{targets[0].port}"),
        *("--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{targets[1].port}"),
        *("--rtt-ms", "40"),
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30))
        assert ready["event"] == "ready" and ready["rtt_ms"] == 40.0
        assert [f"127.0.0.1:{t.port}" for t in targets] == [link["target"] for link in ready["links"]]
        for link, target in zip(ready["links"], targets, strict=True):
            async with connect(int(link["listen"].rsplit(":", 1)[1])) as (reader, writer):
                assert await round_trip((reader, writer)) >= 0.040
                writer.write_eof()
                assert b"" == await asyncio.wait_for(reader.read(), 5)
            assert await asyncio.wait_for(target.ended.get(), 5) is None  # this target, not the other
            assert all(t.ended.empty() for t in targets)
        proc.send_signal(signal.SIGTERM)
        assert 0 == await asyncio.to_thread(proc.wait, 15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        other.close()
        await other.wait_closed()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--listen", "7001", "--target", "127.0.0.1:1", "--rtt-ms", "1"], "expected HOST:PORT"),
        (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:x", "--rtt-ms", "1"], "port must be a number"),
        (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:0", "--rtt-ms", "1"], "needs a port > 0"),
        (["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", "--rtt-ms", "-5"], "must be a finite"),
        (
            ["--listen", "127.0.0.1:0", "--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", "--rtt-ms", "1"],
            "one --target per --listen",
        ),
    ],
)
def test_bad_arguments_are_explained(args: list[str], fragment: str) -> None:
    """Bad flags end with exit code 2 and a one-line reason, not a traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "federation.linkproxy", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert fragment in proc.stderr and "Traceback" not in proc.stderr
