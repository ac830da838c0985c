"""What every long-running program of ours shares: logging and the event loop, the JSON
ready line other programs wait for, stopping on SIGTERM/SIGINT, and argument types."""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import json
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import structlog
import uvloop
from tenacity import AsyncRetrying

from core import logs
from core.tiers import Tier

# gRPC servers: a busy port is an error (gRPC shares it by default, mixing two federations),
# and a burst of new calls is queued, not cancelled: grpc-core cancels calls beyond 1,000
# waiting for the application (3,000 hard), and a gateway opens a stream per request.
# grpc.aio takes waiting calls one per event-loop turn; under an Offline burst (~20 k calls
# at once, the loop busy with the streams already open) that can take longer than grpc-core's
# 30 s before it cancels a call nobody took (the CANCELLED failures noted on issue #3).
GRPC_SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", 50_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
    ("grpc.server_max_unrequested_time_in_server", 1800),  # seconds: as long as a first token may take
    # Clients ping every second to find a silent partition (keepalive_options): such pings
    # must not count as abuse (by default a server answers them with GOAWAY).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    # A gateway's GenerateCommand carries its prompts; it sends at most GENERATE_COMMAND_BYTES
    # of them per message, but one prompt may be the whole 64-MB body the gateway accepts.
    ("grpc.max_receive_message_length", 80 * 1024**2),
)
GENERATE_COMMAND_BYTES = 4 * 1024**2
# A gateway asks at most this many routes in one RouteStream message, and a scheduler refuses
# more: it decides a message's routes before reading the next, and the receive limit above
# would let one message hold a million.
ROUTE_CALLS_PER_MESSAGE = 256
# A gateway sends a replica at most one RouteStream message per this long: a route asked within
# it of the last message waits for the rest of it, so that routes asked faster than this go
# together. A message costs a replica more than the routes in it (at 1,024 sites, issue #44),
# and a route asked after a quiet spell goes at once.
ROUTE_GATHER_S = 0.002

# gRPC clients: after a peer was unreachable (a partition, a restart), reconnect within a second
# of it coming back. grpc-core's default backoff grows to 120 s, so a site healed after a 30-s
# partition rejoined long after the heal in the partition drill (docs/BENCHMARKS.md, "Failover
# drills"). The "minimum reconnect backoff" is grpc-core's minimum connection-attempt timeout,
# not a delay: at 200 ms every attempt to a site across an emulated WAN (a 1.2-s round trip at
# drill speed) or to a busy agent timed out before the server's SETTINGS frame, and a site that
# joined under load failed its first requests until the gateways opened its circuit.
GRPC_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 10_000),
)


# A peer that crashed or was cut off resets its connections, and calls fail at once. One whose
# packets just stop (a link that drops them: a blackhole) is found by HTTP/2 pings: after a
# second with nothing read a ping goes out, and one unanswered for the ping timeout fails every
# call on the connection. grpc-core (1.85) waits on a ping already out (a flow-control probe,
# sent while data flows) for `grpc.http2.ping_timeout_ms`, 60 s by default, whatever
# `keepalive_timeout_ms` says: through a blackholed link, calls were never failed without it,
# and with it they failed soon after it ran out (docs/BENCHMARKS.md, "The silent drills"). The
# timeout must exceed the link's round trip, or every probe fails a healthy connection. Servers
# accept pings this often (GRPC_SERVER_OPTIONS).
def keepalive_options(ping_timeout_s: float = 1.0) -> tuple[tuple[str, int], ...]:
    timeout_ms = max(1000, round(ping_timeout_s * 1000))
    return (
        ("grpc.keepalive_time_ms", 1000),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    )


# A process with ~20 k open streams holds millions of objects; CPython's default thresholds then
# run full collections often, each a long pause that stops every thread (heartbeats included;
# docs/BENCHMARKS.md, "Measured, not declared"). Young collections stay frequent, full ones
# rare, and what start-up built (modules, the tokenizer) is frozen out of them. Generation 1
# is collected every 2 young collections, not 20: each then traverses at most ~100 k objects
# where it could traverse a million, which under a drill's CPU contention stopped an emulator
# for 7-8 s (docs/BENCHMARKS.md, "add-site"). Every object is still traversed once per
# generation, and full collections come as rarely as before (every 2,000 young ones).
GC_THRESHOLDS = (50_000, 2, 1000)
GC_PAUSE_LOGGED_S = 0.2  # a pause this long can make a 1 s heartbeat late: worth a line


class GcPauseLog:
    """Logs every collection that stopped the process for GC_PAUSE_LOGGED_S or more, so a
    late heartbeat can be told from a slow network."""

    def __init__(self) -> None:
        self._started = 0.0
        # Which process paused: in a drill's shared log, a dozen processes of a few kinds.
        main = Path(sys.argv[0])
        self._log = structlog.get_logger("runtime").bind(
            process=main.parent.name if main.stem == "__main__" else main.stem, pid=os.getpid()
        )

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        elif now - self._started >= GC_PAUSE_LOGGED_S:
            pause_s = round(now - self._started, 3)
            self._log.warning(
                "runtime.gc_pause", pause_s=pause_s, generation=info["generation"], collected=info["collected"]
            )


T = TypeVar("T")


async def retried(retrying: AsyncRetrying, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`retrying(fn, *args)`, then the retrying object's own reference cycles broken.

    tenacity keeps the steps of a call as bound methods of the object that runs it, a cycle only
    the collector frees. A gateway builds one or two per request: ~23 objects a request were left
    to the collector, 280 k for each of its generation-1 collections to find, which stopped it
    for up to 1.7 s in the add-site drill (docs/BENCHMARKS.md, "Garbage a request left")."""
    try:
        return await retrying(fn, *args)
    finally:
        retrying.iter_state.reset()


def run(serve: Callable[[argparse.Namespace], Awaitable[int]], args: argparse.Namespace) -> int:
    """Configure logging and the collector, then run `serve(args)` on uvloop; its result is the exit code."""
    logs.configure()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    gc.callbacks.append(GcPauseLog())
    return uvloop.run(serve(args))  # type: ignore[arg-type]


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def announce_ready(**fields: Any) -> None:
    """The one stdout line that says this program serves (see core.processes)."""
    print(json.dumps({"event": "ready", **fields}), flush=True)


def rtt_arg(text: str) -> tuple[str, str, float]:
    """`--rtt-ms ap-northeast-2:us-west-2=130` -> (a, b, 0.130 s): a WAN round trip between regions."""
    try:
        pair, ms = text.split("=")
        a, b = pair.split(":")
        seconds = float(ms) / 1000.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected REGION:REGION=MS, got {text!r}") from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"a round trip is a number of ms >= 0, got {text!r}")
    return a, b, seconds


def patience_arg(text: str) -> tuple[Tier, float]:
    """`--patience-s flex=60` -> (Tier.FLEX, 60.0): the longest a tier's request may expect to wait
    for a site in throughput mode (0: no bound)."""
    name, _, seconds = text.partition("=")
    try:
        tier, value = Tier.named(name), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TIER=SECONDS (priority, default or flex), got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"a patience is a number of seconds >= 0, got {text!r}")
    return tier, value


def rtt_map(links: Iterable[tuple[str, str, float]]) -> dict[tuple[str, str], float]:
    """Both orders of each link's round trip, in seconds."""
    rtt = {}
    for a, b, seconds in links:
        rtt[(a, b)] = rtt[(b, a)] = seconds
    return rtt


def is_loopback(host: str) -> bool:
    """Whether an address to bind reaches this machine only ("localhost", 127.0.0.0/8, ::1).
    Any other name may resolve beyond it, and 0.0.0.0 or :: is every interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def at_least_one(text: str) -> float:
    value = float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
