"""The floor under issue #15's CPU bars on this machine: what the sockets alone cost per event,
with no parsing, no relaying and no gRPC. Two processes, on loopback, nothing else running:

- `read`, the agent's part: a sender writes one SGLang-sized SSE event (a ~250-byte chunk of
  `Transfer-Encoding: chunked`) to each of `--streams` connections every `--tpot-ms` (a decode
  step of a batch of that many); the measured process reads them as the agent does, in a uvloop
  `asyncio.Protocol` whose `data_received` only counts the events.
- `write`, the gateway's part: the measured process writes one such chunk to each of `--streams`
  client connections every `--tpot-ms` (`transport.write`, as `SseClient.flush` does); a client
  process reads them.

Prints the measured process's CPU (user + system, from `os.times`) per event, and the peer's, over
`--seconds` after a few seconds' warm-up. At issue #15's cadence a client's chunk carries ~1.35
tokens, so the gateway's ≤ 10 µs per token is ≤ 13.5 µs per chunk in all; the agent reads every
token as its own event, so its ≤ 15 µs per token is ≤ 15 µs per event in all (docs/BENCHMARKS.md):

    python3 scripts/socket_floor.py read [--streams 1000] [--tpot-ms 77] [--seconds 20]
    python3 scripts/socket_floor.py write
"""

import argparse
import asyncio
import os
import sys
import time

import uvloop

EVENT = (
    b'data: {"text": " the", "output_ids": [1234], "meta_info": {"id": "fed-a3f9c2e1b4d5e6f7a8b9c0d1e2f3a4b5", '
    b'"finish_reason": null, "prompt_tokens": 1250, "weight_version": "default", "num_retractions": 0, '
    b'"reasoning_tokens": 0, "completion_tokens": 345, "cached_tokens": 0}}\n\n'
)
CHUNK = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
WARMUP_S = 5.0


class Counting(asyncio.Protocol):
    """Reads a connection's events and only counts them."""

    events = 0

    def data_received(self, data: bytes) -> None:
        Counting.events += data.count(b"\n\n")


async def _write_steps(transports: list, tpot_s: float, seconds: float) -> tuple[int, float]:
    """A chunk to every transport each step; (chunks written, CPU s) over `seconds` after warm-up."""
    loop = asyncio.get_running_loop()
    written, started, measured_from, cpu0 = 0, loop.time(), None, 0.0
    step = started
    while True:
        step += tpot_s
        await asyncio.sleep(max(0.0, step - loop.time()))
        for transport in transports:
            transport.write(CHUNK)
        now = loop.time()
        if measured_from is None and now - started > WARMUP_S:
            measured_from, cpu0, written = now, _cpu_s(), 0
        elif measured_from is not None:
            written += len(transports)
            if now - measured_from >= seconds:
                return written, _cpu_s() - cpu0


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


async def _serve(tpot_s: float, seconds: float, expect: int, count: bool) -> None:
    """The side that accepts, its port on its first line of output: `count` (the write floor's
    peer) reads and counts what arrives, else it writes a chunk to every connection each step."""
    loop = asyncio.get_running_loop()
    transports: list = []
    all_in = asyncio.Event()

    class Accepted(Counting):
        def connection_made(self, transport) -> None:
            transports.append(transport)
            if len(transports) == expect:
                all_in.set()

    server = await loop.create_server(Accepted, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await all_in.wait()
    if count:
        await asyncio.sleep(WARMUP_S + seconds + 5)
    else:
        written, cpu = await _write_steps(transports, tpot_s, seconds)
        print(f"  the writer (peer): {cpu / written * 1e6:.2f} µs per event", flush=True)


async def _measure(mode: str, streams: int, tpot_s: float, seconds: float) -> None:
    options = ["--streams", str(streams), "--tpot-ms", str(tpot_s * 1000), "--seconds", str(seconds)]
    peer = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--peer", mode, *options, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert peer.stdout is not None
        port = int(await peer.stdout.readline())
        loop = asyncio.get_running_loop()
        transports = [(await loop.create_connection(Counting, "127.0.0.1", port))[0] for _ in range(streams)]
        if mode == "write":
            written, cpu = await _write_steps(transports, tpot_s, seconds)
            print(f"write, {streams} streams: {cpu / written * 1e6:.2f} µs of CPU per chunk written", flush=True)
        else:
            await asyncio.sleep(WARMUP_S)
            events, cpu0, started = Counting.events, _cpu_s(), time.monotonic()
            await asyncio.sleep(seconds)
            events, cpu = Counting.events - events, _cpu_s() - cpu0
            rate = events / (time.monotonic() - started)
            print(f"read, {streams} streams: {cpu / events * 1e6:.2f} µs of CPU per event read ({rate:,.0f}/s)")
        async with asyncio.timeout(WARMUP_S + seconds + 30):
            print((await peer.stdout.read()).decode(), end="")
    finally:
        if peer.returncode is None:
            peer.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["read", "write"])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tpot-ms", type=float, default=77.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tpot = args.tpot_ms / 1000
    if args.peer:  # the read floor's peer writes; the write floor's reads
        uvloop.run(_serve(tpot, args.seconds, args.streams, count=args.mode == "write"))
    else:
        uvloop.run(_measure(args.mode, args.streams, tpot, args.seconds))
