"""The Route load of G gateways, for `fedctl simulate --sites N`: G copies of the gateway's own
scheduler client (federation/gateway/schedulers.py: one RouteStream call per replica, failover,
degraded mode, and a WatchState each), in one process, over mutual TLS with a gateway
certificate. Requests arrive at `--rate` a second (Poisson) from clients spread over the
world's regions, each with MLPerf-like lengths and the prefix hashes a gateway would send (a
shared system prompt of one of PREFIX_GROUPS, then blocks of its own); each decision is handed
to its site on a Generate call, as a gateway does, so that the site's reports acknowledge it.

Every route is recorded (when it was asked, how long its decision took, whether it was decided
by a replica, locally in degraded mode, or not at all), and every state pushed to each gateway
(how long after the replica built it it arrived, and when the sites named by `--watch-sites`
were first seen down). Routes start at SIGUSR1, so that the sites' reports can be measured alone
first. `--out` gets them at exit (SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from core import runtime, wire
from core.errors import NoCapacity
from core.mtls import load_tls
from core.pki import CA_CERT, GATEWAY
from core.supervise import Supervisor
from federation.bench.workload import MLPERF_LIKE_OUTPUTS, MLPERF_LIKE_PROMPTS
from federation.gateway.schedulers import Schedulers
from federation.simulate.agents import SITE_METADATA
from federation.simulate.world import rtt_s

PREFIX_GROUPS = 256  # distinct system prompts (with their tools) the clients' requests start with
SYSTEM_BLOCKS = 16  # a system prompt's length in 64-token blocks (1,024 tokens)
ROUTED, DEGRADED, LOST = 0, 1, 2  # a route's outcome


class Delivery:
    """One Generate call per site this process has routed to, as a gateway process keeps one per
    agent; the finals that come back are only read (the simulated sites answer each request
    with one)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._calls: dict[str, asyncio.Queue[wire.GenerateRequest]] = {}
        self._streams = itertools.count(1)
        self.finished = 0

    def send(self, site: str, address: str, request: wire.GenerateRequest) -> None:
        queue = self._calls.get(site)
        if queue is None:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.aio.insecure_channel(address)
            queue = self._calls[site] = asyncio.Queue()
            call = wire.SiteAgentStub(channel).Generate(self._commands(queue), metadata=((SITE_METADATA, site),))
            self.supervisor.essential(f"generate {site}", self._read(call))
        queue.put_nowait(request)

    async def _commands(self, queue: asyncio.Queue[wire.GenerateRequest]) -> AsyncIterator:
        while True:
            starts = [(next(self._streams), await queue.get())]
            while not queue.empty():
                starts.append((next(self._streams), queue.get_nowait()))
            yield wire.generate_command_to_pb(starts, ())

    async def _read(self, call) -> None:
        try:
            async for batch in call:
                self.finished += len(batch.deltas)
        except grpc.aio.AioRpcError:
            pass  # the site crashed: what it held is not this measurement's


class Load:
    def __init__(self, gateways: list[Schedulers], regions: list[str], rate_per_s: float, watch: list[str]) -> None:
        self.gateways = gateways
        self.regions = regions
        self.rate_per_s = rate_per_s
        self.supervisor = Supervisor()  # a task of this process that fails stops it, loudly
        self.go = asyncio.Event()  # routes are sent once this is set (SIGUSR1): the sites' reports alone come first
        self.delivery = Delivery(self.supervisor)
        self.rng = random.Random(1)
        self.systems = [[self.rng.getrandbits(64) for _ in range(SYSTEM_BLOCKS)] for _ in range(PREFIX_GROUPS)]
        self.asked_at: list[float] = []  # wall clock, per route
        self.took_s: list[float] = []
        self.outcome: list[int] = []
        self.lost_because: dict[str, int] = {}  # why routes were not decided, and how many each
        self.pushes: list[tuple[float, float]] = []  # (arrived at, since the replica built it), every push
        self.down_seen: dict[str, list[float]] = {name: [] for name in watch}  # per site: each gateway's first sight

    def _request(self, number: int) -> wire.RouteRequest:
        rng = self.rng
        prompt = MLPERF_LIKE_PROMPTS.draw(rng)
        blocks = prompt // 64
        shared = rng.choice(self.systems)[:blocks]
        own = [rng.getrandbits(64) for _ in range(blocks - len(shared))]
        return wire.RouteRequest(
            f"sim-{number}",
            prompt,
            MLPERF_LIKE_OUTPUTS.draw(rng),
            client_region=rng.choice(self.regions),
            prefix_hashes=tuple(shared + own),
        )

    async def send_forever(self) -> None:
        await self.go.wait()
        loop = asyncio.get_running_loop()
        due = loop.time()
        for number in itertools.count():
            due += self.rng.expovariate(self.rate_per_s)
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            gateway = self.gateways[number % len(self.gateways)]
            self.supervisor.brief("route", self._one(gateway, self._request(number)))

    async def _one(self, gateway: Schedulers, req: wire.RouteRequest) -> None:
        asked_at, started = time.time(), time.perf_counter()
        try:
            decision = await gateway.route(req)
        except NoCapacity as exc:
            outcome = LOST
            self.lost_because[str(exc)] = self.lost_because.get(str(exc), 0) + 1
        else:
            outcome = DEGRADED if decision.reason == "degraded" else ROUTED
        self.asked_at.append(asked_at)
        self.took_s.append(time.perf_counter() - started)
        self.outcome.append(outcome)
        if outcome != LOST:
            self.delivery.send(
                decision.site,
                decision.agent_address,
                wire.GenerateRequest(req.request_id, req.prompt_tokens, {"max_new_tokens": req.max_tokens}),
            )

    async def watch_forever(self, gateway: Schedulers) -> None:
        seen: set[str] = set()
        while True:
            await gateway.state_changed(1.0)
            state = gateway.state
            if state is None:
                continue
            now = time.time()
            if state.built_unix_s:
                self.pushes.append((now, now - state.built_unix_s))
            for site in state.sites:
                if site.name in self.down_seen and site.name not in seen and site.status is wire.SiteStatus.DOWN:
                    seen.add(site.name)
                    self.down_seen[site.name].append(now)

    def ready(self, sites: int) -> bool:
        """Every gateway watches a state in which all `sites` are ready."""
        for g in self.gateways:
            ready = g.state is not None and sum(s.status is wire.SiteStatus.READY for s in g.state.sites)
            if ready != sites:
                return False
        return True

    def results(self) -> dict:
        return {
            "asked_at": self.asked_at,
            "took_s": self.took_s,
            "outcome": self.outcome,
            "pushes": self.pushes,
            "down_seen": self.down_seen,
            "finished": self.delivery.finished,
            "lost_because": self.lost_because,
            "route_messages": sum(g.route_messages_sent for g in self.gateways),
        }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m federation.simulate.gateways", description=__doc__)
    p.add_argument("--world", type=Path, required=True, help="the sites, as `fedctl simulate` wrote them")
    p.add_argument("--schedulers", required=True, help="the replicas' addresses, comma-separated")
    p.add_argument("--tls-dir", type=Path, required=True, help="the run's CA and certificates")
    p.add_argument("--gateways", type=runtime.positive_int, required=True)
    p.add_argument("--rate", type=runtime.positive_float, required=True, help="routes a second, over all gateways")
    p.add_argument(
        "--route-gather-ms",
        type=runtime.non_negative_float,
        default=runtime.ROUTE_GATHER_S * 1000.0,
        help="at most one RouteStream message per this long (runtime.ROUTE_GATHER_S)",
    )
    p.add_argument("--watch-sites", default="", help="sites whose first sight as down is recorded, comma-separated")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> int:
    runtime.ROUTE_GATHER_S = args.route_gather_ms / 1000.0
    world = json.loads(args.world.read_text())
    stem = args.tls_dir / GATEWAY.file_stem
    tls = load_tls(args.tls_dir / CA_CERT, stem.with_suffix(".crt"), stem.with_suffix(".key"), GATEWAY)
    regions = sorted({s["region"] for s in world})
    gateways = [
        Schedulers(args.schedulers.split(","), rtt_s=rtt_s(tuple(regions)), tls=tls) for _ in range(args.gateways)
    ]
    load = Load(gateways, regions, args.rate, [n for n in args.watch_sites.split(",") if n])
    for g in gateways:
        g.start()
    for i, g in enumerate(gateways):
        load.supervisor.essential(f"watch {i}", load.watch_forever(g))
    while not load.ready(len(world)):
        await gateways[0].state_changed(0.5)
    load.supervisor.essential("send", load.send_forever())
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, load.go.set)
    stop = runtime.stop_event()
    runtime.announce_ready(gateways=len(gateways))
    failed = asyncio.ensure_future(load.supervisor.failed.wait())
    await asyncio.wait([asyncio.ensure_future(stop.wait()), failed], return_when=asyncio.FIRST_COMPLETED)
    await load.supervisor.close()
    args.out.write_text(json.dumps(load.results()))
    return load.supervisor.exit_code


def main(argv: list[str] | None = None) -> int:
    return runtime.run(serve, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
