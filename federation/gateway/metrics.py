"""The gateway's Prometheus metrics: requests by outcome, retries, resumed streams, and the
output tokens each site delivered to clients (what a site's share of the traffic really is,
counted as the tokens pass, so a resumed answer's tail is the site's that wrote it).

Several gateway processes share a port (SO_REUSEPORT), and a scrape reaches one of them at
random: with PROMETHEUS_MULTIPROC_DIR set (as `fedctl up` does for them), each process keeps
its counts in that directory and any of them answers with the sum of all (prometheus-client's
multiprocess mode). Without it, a process answers for itself.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from core import supervise
from core.cpu_clock import CpuClock

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

REGISTRY = CollectorRegistry()
REQUESTS = Counter("federation_gateway_requests", "Requests finished, by outcome.", ["outcome"], registry=REGISTRY)
RETRIES = Counter(
    "federation_gateway_retries", "Attempts on another site before a request's first token.", registry=REGISTRY
)
RESUMED = Counter(
    "federation_gateway_resumed", "Streams cut mid-answer and continued on another site.", registry=REGISTRY
)

ROUTE_CALLS = Counter(
    "federation_gateway_route_calls",
    "Routes asked of scheduler replicas (each in a RouteStream message): "
    "kind=route commits a request, kind=dry_run only asks (latency mode).",
    ["kind"],
    registry=REGISTRY,
)
CIRCUIT_OPEN = Gauge(
    "federation_gateway_circuit_open",
    "1 while this gateway sends a site no new requests (its circuit open, or half-open with its one trial out).",
    ["site"],
    registry=REGISTRY,
    multiprocess_mode="max",
)
CIRCUIT_OPENED = Counter(
    "federation_gateway_circuit_opened",
    "Times a site's circuit opened after failures in a row.",
    ["site"],
    registry=REGISTRY,
)

OUTPUT_TOKENS = Counter(
    "federation_gateway_output_tokens",
    "Output tokens relayed to clients, by the site that generated them.",
    ["site"],
    registry=REGISTRY,
)

KEY_REQUESTS = Counter(
    "federation_gateway_key_requests",
    "Requests finished, by API key name and outcome.",
    ["key", "outcome"],
    registry=REGISTRY,
)
KEY_TOKENS = Counter(
    "federation_gateway_key_tokens",
    "Tokens used by each API key: kind=prompt (of requests admitted) or output (delivered).",
    ["key", "kind"],
    registry=REGISTRY,
)
REFUSED_KEYS = Counter(
    "federation_gateway_refused",
    'Requests refused before any site was asked: reason=no_key (401) or over_limit (429), by key ("" without one).',
    ["reason", "key"],
    registry=REGISTRY,
)

QUOTA_STORE_UP = Gauge(
    "federation_gateway_quota_store_up",
    "1 while this region's quota store (Redis) answers; 0: each gateway admits on its own share of a key's limits.",
    registry=REGISTRY,
    multiprocess_mode="min",
)
QUOTA_LEASES = Counter(
    "federation_gateway_quota_leases",
    "Slices of keys' budgets this gateway topped up for its region: outcome=granted (by the key's home), "
    "self (the home unreachable: the one lease a region grants itself) or refused (that one already out).",
    ["outcome"],
    registry=REGISTRY,
)

REFUSED_CONNECTIONS = Counter(
    "federation_gateway_refused_connections",
    "Connections answered 429 and closed at once: their client address had its cap of open ones.",
    registry=REGISTRY,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
ROUTE_SECONDS = Histogram(
    "federation_gateway_route_seconds",
    "From a request's arrival to its Route decided (its first, when it was retried).",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TTFT_SECONDS = Histogram(
    "federation_gateway_ttft_seconds",
    "From a request's arrival to its first chunk relayed, by the site that made it.",
    ["site"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TPOT_SECONDS = Histogram(
    "federation_gateway_tpot_seconds",
    "A finished request's mean time per output token after its first, by the site that ended it.",
    ["site"],
    buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2),
    registry=REGISTRY,
)
TIER_REQUESTS = Counter(
    "federation_gateway_tier_requests",
    "Requests finished, by service tier and outcome (ok, error, refused: 429 with Retry-After, client_gone).",
    ["tier", "outcome"],
    registry=REGISTRY,
)
TIER_TTFT_SECONDS = Histogram(
    "federation_gateway_tier_ttft_seconds",
    "From a request's arrival to its first chunk relayed, by service tier.",
    ["tier"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TIER_HELD = Gauge(
    "federation_gateway_tier_held_requests",
    "Requests in the latency mode's hold queue, by service tier.",
    ["tier"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
DEGRADED = Gauge(
    "federation_gateway_degraded",
    "1 while no scheduler replica answers and routes come from the last state watched.",
    registry=REGISTRY,
    multiprocess_mode="max",
)
HELD = Gauge(
    "federation_gateway_held_requests",
    "Requests waiting in the latency mode's hold queue for a site that can meet their TTFT budget.",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
# A gauge, not a counter: in multiprocess mode counters are summed over the processes, and what an
# operator asks is whether any one process's loop is near its core (core/cpu_clock.py); each live
# process is its own series (a `pid` label).
CPU_SECONDS = Gauge(
    "federation_gateway_cpu_seconds",
    "CPU seconds of this gateway process: part=loop (its event loop's thread, which runs on one core) or "
    "process (every thread); written twice a second.",
    ["part"],
    registry=REGISTRY,
    multiprocess_mode="liveall",
)


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """When a finished request reached each point, by the monotonic clock (None: never)."""

    arrived: float
    routed: float | None
    first_chunk: float | None
    ended: float
    first_site: str
    last_site: str
    output_tokens: int
    tier: str = "default"  # its service tier's name


def observe(t: RequestTimes) -> None:
    if t.routed:
        ROUTE_SECONDS.observe(t.routed - t.arrived)
    if t.first_chunk and t.first_site:
        TTFT_SECONDS.labels(t.first_site).observe(t.first_chunk - t.arrived)
        TIER_TTFT_SECONDS.labels(t.tier).observe(t.first_chunk - t.arrived)
        if t.output_tokens > 1 and t.last_site:
            TPOT_SECONDS.labels(t.last_site).observe((t.ended - t.first_chunk) / (t.output_tokens - 1))


# Tokens relayed since the last flush, by site: counted per chunk here (`RELAYED[site] += n`, a
# dict add), and added to the Prometheus counter once a FLUSH_INTERVAL_S and as each request ends
# (in multiprocess mode every increment is a write to a shared file: per chunk, a few % of the
# gateway's CPU at per-token pace).
RELAYED: dict[str, int] = defaultdict(int)
FLUSH_INTERVAL_S = 0.5


def flush_relayed() -> None:
    for site, count in RELAYED.items():
        OUTPUT_TOKENS.labels(site).inc(count)
    RELAYED.clear()


def start_flushing(degraded: Callable[[], bool], held: Callable[[], dict[str, int]]) -> asyncio.Task[None]:
    """`flush_forever`, restarted if it ever raises (core.supervise)."""
    return supervise.restarting("gateway.metrics_flush", lambda: flush_forever(degraded, held))


async def flush_forever(degraded: Callable[[], bool], held: Callable[[], dict[str, int]]) -> None:
    """The token counts, and the gauges of this process's state, written out twice a second
    (in multiprocess mode a scrape reads what each process last wrote). `held`: the hold
    queue's requests by service tier."""
    cpu = CpuClock()  # made here, on the loop's thread
    while True:
        await asyncio.sleep(FLUSH_INTERVAL_S)
        flush_relayed()
        DEGRADED.set(1 if degraded() else 0)
        by_tier = held()
        HELD.set(sum(by_tier.values()))
        for tier, count in by_tier.items():
            TIER_HELD.labels(tier).set(count)
        for part, seconds in cpu.seconds().items():
            CPU_SECONDS.labels(part).set(seconds)


def process_exiting() -> None:
    """This process's live gauges leave the shared directory with it (its held requests and CPU
    would otherwise be read as a live process's)."""
    if os.environ.get(MULTIPROCESS_DIR_ENV):
        multiprocess.mark_process_dead(os.getpid())


def request_done(outcome: str, retries: int, resumed: int, tier: str = "default", refused: bool = False) -> None:
    """A request ended: its tokens are counted now (a scrape right after it sees them all)."""
    flush_relayed()
    REQUESTS.labels(outcome).inc()
    TIER_REQUESTS.labels(tier, "refused" if refused else outcome).inc()
    if retries:
        RETRIES.inc(retries)
    if resumed:
        RESUMED.inc(resumed)


async def handler(request: web.Request) -> web.Response:
    flush_relayed()
    registry = REGISTRY
    if os.environ.get(MULTIPROCESS_DIR_ENV):  # every gateway process's counts, summed
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def key_usage(key: str, outcome: str, prompt_tokens: int, output_tokens: int) -> None:
    KEY_REQUESTS.labels(key, outcome).inc()
    KEY_TOKENS.labels(key, "prompt").inc(prompt_tokens)
    KEY_TOKENS.labels(key, "output").inc(output_tokens)
