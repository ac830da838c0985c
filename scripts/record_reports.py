"""Record what a real site agent reports while something happens to its site, for the capacity
estimator's tests (tests/data/reports/*.json, replayed by tests/test_capacity_recorded.py).

    python3 scripts/record_reports.py SCENARIO OUT.json

A real agent over real emulated workers (4 x MI300X at full speed, one event per token) reports
to a recording scheduler here, which keeps every registration and report with the second it
came (the agent's reporter sends at the schedulers' interval). Load comes through the agent's
own Generate, as a gateway's would: 1,000-token prompts, 200-token answers, each finished one
replaced. Scenarios:

- `resume-wave`: one of the four workers dies; its streams are resumed at the site as the
  gateway resumes them (the prompt plus what was said, the rest of the budget), all at once.
- `loop-stall`: the agent's process is stopped (SIGSTOP) for 2 s, three times.
- `brownout`: every worker runs 4 times slower.
- `join`: the site registers idle and load arrives at once.

The file holds the truth beside the reports: the GPU, the workers healthy and the slowdown from
each second on, and the workload, so a test can say what the site could deliver at every report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from core import wire
from core.errors import UpstreamFailed
from core.processes import free_port_block, start_python
from federation.gateway.upstream import SiteStream, Upstream
from nodes.emulator.launch import launch

GPU, WORKERS, SPEED = "mi300x", 4, 1.0
PROMPT, OUTPUT = 1000, 200
OPEN = 4 * 300  # more than the slots (4 x 256): the site is full, with a queue
REPORT_INTERVAL_S = 0.25
WARMUP_S, BEFORE_S, AFTER_S = 40.0, 20.0, 40.0
SLOWDOWN = 4.0


class Recorder(wire.SchedulerServicer):
    """A scheduler that only listens: it keeps what the site says, and when."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.registrations: list[dict[str, Any]] = []
        self.reports: list[dict[str, Any]] = []

    def _t(self) -> float:
        return round(time.monotonic() - self.started, 4)

    async def RegisterSite(self, request, context):
        reg = wire.registration_from_pb(request)
        self.registrations.append({"t": self._t(), **_plain(reg)})
        return wire.registered_to_pb(wire.Registered(reg.name, 0.0, REPORT_INTERVAL_S))

    async def Report(self, request_iterator, context):
        async for message in request_iterator:
            report = wire.report_from_pb(message)
            self.reports.append({"t": self._t(), **_plain(report)})
        return
        yield


def _plain(value: Any) -> dict[str, Any]:
    out = {}
    for name in value.__dataclass_fields__:
        v = getattr(value, name)
        if name == "received_ids":
            continue
        out[name] = _plain(v) if hasattr(v, "__dataclass_fields__") else v
    return out


class Load:
    """OPEN requests at the agent, each finished one replaced; a failed one resumed as the
    gateway resumes (prompt + what was said, the rest of the budget)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.upstream = Upstream()
        self.number = 0
        self.running = True
        self.resumed = 0

    async def lane(self) -> None:
        while self.running:
            await self._one(PROMPT, OUTPUT)

    async def _one(self, prompt: int, budget: int) -> None:
        resumed_tokens = 0
        while self.running and budget > 0:
            self.number += 1
            said = 0

            def deliver(stream: SiteStream, delta: wire.TokenDelta) -> None:
                nonlocal said
                said = delta.completion_tokens

            ids = tuple((self.number * 7 + i) % 50_000 + 1000 for i in range(prompt))
            params = {"max_new_tokens": budget, "ignore_eos": True}
            request = wire.GenerateRequest(
                f"r{self.number}", prompt, params, input_ids=ids, resumed_tokens=resumed_tokens
            )
            stream = self.upstream.start("s", f"127.0.0.1:{self.port}", request, deliver)
            try:
                await stream.first
                await stream.done
                return
            except UpstreamFailed:
                prompt, budget = prompt + said, budget - said  # resumed where it stopped, as the gateway does
                resumed_tokens += said
                self.resumed += 1
            finally:
                stream.close()


async def _record(scenario: str) -> dict[str, Any]:
    emulator = launch(["--profile", GPU, "--workers", str(WORKERS), "--speed", str(SPEED), "--enable-faults"])
    recorder = Recorder()
    server = grpc.aio.server()
    wire.add_scheduler_to_server(recorder, server)
    scheduler_port = free_port_block(1)
    server.add_insecure_port(f"127.0.0.1:{scheduler_port}")
    await server.start()
    port = free_port_block(2)
    args = ["--insecure", "--site", "s", "--region", "r", "--gpu", GPU, "--gpus", str(WORKERS), "--port", str(port)]
    args += ["--metrics-port", str(port + 1), "--speed", str(SPEED), "--scheduler", f"127.0.0.1:{scheduler_port}"]
    for url in emulator.urls:
        args += ["--worker-url", url]
    agent = start_python("agent", "nodes.agent", args)
    load = Load(port)
    truth: list[dict[str, Any]] = [{"t": 0.0, "healthy": WORKERS, "slowdown": 1.0}]
    lanes: list[asyncio.Task[None]] = []
    try:
        if scenario == "join":
            await asyncio.sleep(5.0)  # registered and idle
        lanes = [asyncio.ensure_future(load.lane()) for _ in range(OPEN)]
        await asyncio.sleep(5.0 if scenario == "join" else WARMUP_S + BEFORE_S)
        fault_at = recorder._t()
        async with aiohttp.ClientSession() as http:
            if scenario == "resume-wave":
                async with http.post(emulator.urls[-1] + "/_emulator/die") as resp:
                    await resp.read()
                truth.append({"t": fault_at, "healthy": WORKERS - 1, "slowdown": 1.0})
            elif scenario == "brownout":
                for url in emulator.urls:
                    async with http.post(url + "/_emulator/faults", json={"slowdown": SLOWDOWN}) as resp:
                        await resp.read()
                truth.append({"t": fault_at, "healthy": WORKERS, "slowdown": SLOWDOWN})
            elif scenario == "loop-stall":
                for _ in range(3):
                    os.kill(agent.pid, signal.SIGSTOP)
                    await asyncio.sleep(2.0)
                    os.kill(agent.pid, signal.SIGCONT)
                    await asyncio.sleep(8.0)
        await asyncio.sleep(AFTER_S)
    finally:
        load.running = False
        for lane in lanes:
            lane.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)
        await load.upstream.close()
        agent.stop()
        emulator.stop()
        await server.stop(0)
    return {
        "scenario": scenario,
        "how": "scripts/record_reports.py: a real agent over 4 emulated MI300X at full speed, per-token streams",
        "gpu": GPU,
        "workers": WORKERS,
        "clock_speed": SPEED,
        "fault_at_s": fault_at,
        "workload": {"prompt_tokens": PROMPT, "output_tokens": OUTPUT},
        "truth": truth,
        "resumed": load.resumed,
        "registrations": recorder.registrations,
        "reports": recorder.reports,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=["resume-wave", "loop-stall", "brownout", "join"])
    p.add_argument("out", type=Path)
    args = p.parse_args()
    recorded = asyncio.run(_record(args.scenario))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(recorded, separators=(",", ":")) + "\n")
    print(f"{args.scenario}: {len(recorded['reports'])} reports, {recorded['resumed']} resumed -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
