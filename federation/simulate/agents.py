"""Many simulated sites in one process, for `fedctl simulate --sites N`: each registers with every
scheduler replica over mutual TLS with its own site certificate, reports at the cadence the
replica gives it, and takes the requests routed to it, as a real agent does; what it reports
comes from the GPU model of its GPUs running those requests (federation/simulate/site.py).

What a real agent does and these do not: there are no workers and no token streams. A request
is taken on a Generate call (one per gateway stand-in process and site; the site is named in the
call's metadata, since one server stands in for many agents) and answered with one final delta
when the model has finished it. That call is plaintext on loopback: the sites' own trust is not
what this measures; everything that reaches a scheduler is mutual TLS.

`python -m federation.simulate.agents --world F --first I --count K --schedulers A,B --tls-dir D
--out O`: sites I..I+K-1 of the world file. SIGUSR1 crashes the first of them (its connections to
the schedulers close, as a killed process's do); SIGUSR2 silences the second (its reports stop,
its connections stay open, as a frozen host's). Their times go to `--out` at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from core import runtime, wire
from core.mtls import load_tls
from core.pki import CA_CERT, SCHEDULER, Identity, Role
from core.supervise import Supervisor
from core.work import expected_output_tokens
from federation.simulate.site import Request, SiteModel
from federation.simulate.world import SimSite

log = structlog.get_logger("simulate.agents")

SITE_METADATA = "federation-simulated-site"  # names the site a Generate call is for
MODEL = "openai/gpt-oss-120b"
READ_S = 1.0  # a site's model is advanced this often: an agent reads its workers' /metrics once a second
TICK_S = 0.005  # reports due are sent this often: a site's report is at most this late
REGISTER_AT_ONCE = 64  # registrations (TLS handshakes) in flight at once


@dataclass
class SimAgent:
    """One simulated site: its model, as last read, and what it owes each replica's report stream."""

    spec: SimSite
    model: SiteModel
    address: str
    streams: dict[int, asyncio.Queue[Any]] = field(default_factory=dict)  # each replica's reports, as protobuf
    received: dict[int, list[str]] = field(default_factory=dict)  # request ids since the last report, per replica
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    waiting: dict[int, tuple[int, asyncio.Queue]] = field(default_factory=dict)  # rid -> (stream, its call's answers)
    prompt_total: int = 0
    output_total: int = 0
    silent: bool = False
    read_at: float = 0.0  # when its model was last advanced (its workers' metrics read)
    interval_s: float = 0.25  # it reports this often, as the replicas told it (the longest they said)
    said: int = 0  # its batch's output so far, as last read
    read: Any = None  # what that read says, less the load (protobuf: copied for each report)

    def advance(self, now: float) -> list[Request]:
        """Move its model on to `now`, as an agent reads its workers' /metrics: the requests that finished."""
        m = self.model
        finished = m.tick(self.read_at, now - self.read_at) if self.read_at else []
        self.read_at = now
        for request in finished:
            self.prompt_total += request.prompt
            self.output_total += request.target
        self.said = m.said_in_batch()
        context = m.context_tokens
        self.read = wire.report_to_pb(
            wire.SiteReport(
                site=self.spec.name,
                healthy_workers=self.spec.gpus,
                total_workers=self.spec.gpus,
                running_requests=m.running,
                context_tokens=context,
                kv_usage=context / (self.spec.gpus * m.profile.kv_capacity_tokens),
                slots=m.slots,
                prompt_tokens_total=self.prompt_total,
                generation_tokens_total=self.output_total,
                work=m.work_done(),
                accounting_workers=self.spec.gpus,
            )
        )
        return finished

    def report(self, replica: int) -> Any:
        """Its report to `replica`: the last read, the requests it holds now, those it took since."""
        m = self.model
        ids, self.received[replica] = self.received.get(replica, []), []
        queued = len(m.waiting) + len(m.prefilling)
        return wire.report_refreshed_pb(self.read, queued, m.held, m.outstanding_tokens(self.said), ids)


class Agents:
    def __init__(self, sites: list[SimSite], schedulers: list[str], tls_dir: Path, address: str) -> None:
        self.schedulers = schedulers
        self.tls_dir = tls_dir
        self.agents = {s.name: SimAgent(s, SiteModel(s, lambda a, b: 0.0), address) for s in sites}
        self.reports_sent = 0
        self.taken = 0
        self.events: dict[str, dict[str, object]] = {}
        self._rid = 0
        self.supervisor = Supervisor()  # a task of this process that fails stops it, loudly

    # ---- the schedulers' side ---------------------------------------------------------

    async def register_all(self) -> None:
        gate = asyncio.Semaphore(REGISTER_AT_ONCE)

        async def one(agent: SimAgent) -> None:
            async with gate:
                await self._register(agent)

        async with asyncio.TaskGroup() as tg:
            for agent in self.agents.values():
                tg.create_task(one(agent))

    async def _register(self, agent: SimAgent) -> None:
        name = agent.spec.name
        identity = Identity(Role.SITE, name)
        stem = self.tls_dir / identity.file_stem
        tls = load_tls(self.tls_dir / CA_CERT, stem.with_suffix(".crt"), stem.with_suffix(".key"), identity)
        options = runtime.keepalive_options() + runtime.GRPC_CHANNEL_OPTIONS
        reg = wire.SiteRegistration(name, agent.spec.region, agent.spec.gpu, agent.spec.gpus, agent.address, MODEL)
        for replica, address in enumerate(self.schedulers):
            channel = tls.channel(address, SCHEDULER, options)
            agent.channels.append(channel)
            stub = wire.SchedulerStub(channel)
            registered = wire.registered_from_pb(await stub.RegisterSite(wire.registration_to_pb(reg), timeout=30))
            agent.interval_s = max(agent.interval_s, registered.report_interval_s)
            queue: asyncio.Queue[Any] = asyncio.Queue()
            agent.streams[replica] = queue
            if not agent.read_at:
                agent.advance(time.monotonic())
            queue.put_nowait(agent.report(replica))
            call = stub.Report(self._reports(queue))
            self.supervisor.essential(f"commands {name}", self._commands(call, agent, replica))

    async def _reports(self, queue: asyncio.Queue[Any]) -> AsyncIterator:
        while (report := await queue.get()) is not None:
            self.reports_sent += 1
            yield report

    @staticmethod
    async def _commands(call, agent: SimAgent, replica: int) -> None:
        """The replica's commands (a slower pace is followed; no drain or removal is sent here)
        until the stream ends: the site then stops reporting to that replica (a simulated site
        does not register again)."""
        try:
            async for message in call:
                command = wire.command_from_pb(message)
                if command.command is wire.Command.REPORT_EVERY:
                    agent.interval_s = max(agent.interval_s, command.report_interval_s)
        except grpc.aio.AioRpcError:
            pass
        agent.streams.pop(replica, None)
        agent.received.pop(replica, None)

    async def report_forever(self) -> None:
        """Report each site when its interval is up, each at a phase of its own (agents are not in
        step); its model is read every READ_S, as an agent reads its workers' metrics."""
        rng = random.Random(0)
        due = [(time.monotonic() + rng.uniform(0, a.interval_s), i, a) for i, a in enumerate(self.agents.values())]
        heapq.heapify(due)
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            while due[0][0] <= now:
                _, i, agent = heapq.heappop(due)
                heapq.heappush(due, (now + agent.interval_s, i, agent))
                if agent.silent or not agent.model.alive or not agent.streams:
                    continue
                if now - agent.read_at >= READ_S:
                    for request in agent.advance(now):
                        self._finished(agent, request)
                for replica, queue in agent.streams.items():
                    queue.put_nowait(agent.report(replica))

    def crash(self) -> None:
        """The first site dies as a killed process does: its connections close."""
        agent = next(iter(self.agents.values()))
        self.events["crashed"] = {"site": agent.spec.name, "at_unix_s": time.time()}
        agent.model.fail()
        agent.streams.clear()
        for channel in agent.channels:
            self.supervisor.essential("crash", channel.close())

    def silence(self) -> None:
        """The second site falls silent, as a frozen host does: connections open, nothing sent."""
        agent = list(self.agents.values())[1]
        self.events["silenced"] = {"site": agent.spec.name, "at_unix_s": time.time()}
        agent.silent = True

    # ---- the gateways' side -----------------------------------------------------------

    def _finished(self, agent: SimAgent, request: Request) -> None:
        stream, answers = agent.waiting.pop(request.rid)
        answers.put_nowait(wire.TokenDelta(stream, "", (), request.target, request.prompt, {"type": "length"}))

    async def generate(self, request_iterator, context) -> AsyncIterator:
        name = dict(context.invocation_metadata()).get(SITE_METADATA, "")
        agent = self.agents.get(name)
        if agent is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no simulated site {name!r} here")
        answers: asyncio.Queue = asyncio.Queue()

        async def take() -> None:
            async for message in request_iterator:
                now = time.monotonic()
                for start in wire.generate_command_from_pb(message).starts:
                    self._take(agent, start, answers, now)

        reader = asyncio.ensure_future(take())
        try:
            while True:
                delta = await answers.get()
                batch = [delta]
                while not answers.empty():
                    batch.append(answers.get_nowait())
                yield wire.token_batch_to_pb(batch)
        finally:
            reader.cancel()

    def _take(
        self, agent: SimAgent, start: tuple[int, wire.GenerateRequest], answers: asyncio.Queue, now: float
    ) -> None:
        stream, req = start
        self.taken += 1
        max_tokens = int(req.sampling_params.get("max_new_tokens", 0))
        self._rid += 1
        rid = self._rid
        request = Request(
            rid, agent.spec.region, req.prompt_tokens, max(1, max_tokens), expected_output_tokens(max_tokens), now
        )
        for ids in agent.received.values():
            ids.append(req.request_id)
        if not agent.model.alive:
            return
        agent.waiting[rid] = (stream, answers)
        agent.model.send(request, now)


class _Servicer(wire.SiteAgentServicer):
    def __init__(self, agents: Agents) -> None:
        self.agents = agents

    async def Generate(self, request_iterator, context) -> AsyncIterator:
        async for batch in self.agents.generate(request_iterator, context):
            yield batch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m federation.simulate.agents", description=__doc__)
    p.add_argument("--world", type=Path, required=True, help="the sites, as `fedctl simulate` wrote them")
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--schedulers", required=True, help="the replicas' addresses, comma-separated")
    p.add_argument("--tls-dir", type=Path, required=True, help="the run's CA and certificates")
    p.add_argument("--port", type=int, required=True, help="where Generate is served (plaintext, loopback)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> int:
    world = [SimSite(**s) for s in json.loads(args.world.read_text())]
    address = f"127.0.0.1:{args.port}"
    agents = Agents(world[args.first : args.first + args.count], args.schedulers.split(","), args.tls_dir, address)
    server = grpc.aio.server(options=runtime.GRPC_SERVER_OPTIONS)
    wire.add_site_agent_to_server(_Servicer(agents), server)
    server.add_insecure_port(address)
    await server.start()
    # Sites report from the moment each has registered, as agents that start on their own do.
    agents.supervisor.essential("reports", agents.report_forever())
    await agents.register_all()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, agents.crash)
    loop.add_signal_handler(signal.SIGUSR2, agents.silence)
    stop = runtime.stop_event()
    runtime.announce_ready(agents=address, sites=len(agents.agents))
    await asyncio.wait(
        [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(agents.supervisor.failed.wait())],
        return_when=asyncio.FIRST_COMPLETED,
    )
    await agents.supervisor.close()
    args.out.write_text(json.dumps({"reports_sent": agents.reports_sent, "taken": agents.taken, **agents.events}))
    await server.stop(0)
    return agents.supervisor.exit_code


def main(argv: list[str] | None = None) -> int:
    return runtime.run(serve, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
