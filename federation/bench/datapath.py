"""`fedctl bench --datapath`: what carrying the tokens costs, per token and per hop, at SGLang's pace.

A real SGLang worker sends one stream event per decode step (`--stream-interval 1`), and at
MLPerf's load a step takes ~70-80 ms: every stream gets an event every ~75 ms. That is the pace
this measures at: the embedded default's processes and topology (two scheduler replicas, the
gateway, Korea behind the 130-ms WAN link and the US beside it), with fewer GPUs so that
emulating them at real speed fits this machine (`DATAPATH_GPUS`), workers streaming an event per
token, and as many requests held open as the sites have slots, so the batches are full and the
TPOT is MLPerf's (the JSON says the TPOT it measured).

Three phases on the same workers, each a closed loop of streamed /v1/completions with a
warm-up and then a measured window:
- `federation`: our data path, chunks as the endpoint coalesces them (the default);
- `federation every event`: clients asking for every worker event as its own chunk
  (`stream_interval: 1` in the request), SGLang's own default;
- `sglang-router`: the real sglang-router (Rust) relaying the same per-token streams from the
  same workers to the same clients, the remote workers behind the same WAN link.

For each, the CPU time (user + system, from psutil) every process spent in the window, by kind
(gateway, agent, scheduler, emulator, link, router, and the bench's own clients), over the
output tokens and the stream events the clients received in it; tokens/s and events/s; and for
the federation the hop overhead: from the gateway receiving a request to the site's agent taking
it, less the link's one-way delay (the gateway's `Server-Timing: hop`; one machine, one clock),
and the part of it until the route was decided (`route`).
Every process is on loopback: a socket write's kernel time includes the receiver's side too.
And every process shares this machine's cores: each kind's mean wait for a core after a wakeup
(`runqueue_wait_us_per_wakeup`, from the kernel's schedstat) says how much of the hop overhead,
a chain of wakeups across the gateway, the scheduler and the agent, was a queue for the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from core.config import Config, load
from core.gpus import PROFILES
from federation.bench import scenarios
from federation.bench.peers import FlatRouter
from federation.bench.workload import Sample
from federation.embedded import Federation
from nodes.agent.readers import READER_MODULE

# The embedded default's sites with this many GPUs each: at real speed and full batches these
# send ~20 k events/s, what this machine can emulate, relay and read at once (the issue's own
# repro used the same two sites, at a quarter speed).
DATAPATH_GPUS = {"kr-mi300x": 2, "us-mi355x": 1}
WARMUP_S = 60.0  # the opening burst's prefill done and every stream decoding at the batch's pace
WINDOW_S = 60.0
RAMP_S = 20.0  # the open requests start over this long (half the warm-up at most), not all in one burst
ROUTER_POLICY = "round_robin"
# A phase whose window kept the machine's cores this busy measured a machine out of CPU: every
# hop then waits its turn (the hop overhead is queueing), and its per-event costs are not those
# of a machine with CPU to spare (docs/DATAPATH.md, "Measured"). Its figures are reported,
# flagged, not comparable with an unsaturated run's.
SATURATED_SHARE = 0.9


def datapath_config(path: Path | None, speed: float, stream_interval: int, on_free_ports) -> Config:
    """The federation measured: `--config`'s, else the embedded default with DATAPATH_GPUS; one
    gateway process (its CPU is the one per-token cost measured), open to any number of
    connections from the load generator's one address."""
    config = load(path)
    if path is None:
        config = config.with_gpus(DATAPATH_GPUS)
    config = config.with_overrides(speed=speed, stream_interval=stream_interval)
    scaled = {k: v / config.speed for k, v in config.rtt_ms.items()}
    config = dataclasses.replace(config, rtt_ms=scaled, control_rtt_ms=config.rtt_ms).with_gateway(
        max_connections_per_address=0
    )
    return on_free_ports(config)


def full_batches(config: Config) -> int:
    """Requests that fill every worker's running slots: the TPOT is then what a loaded site's is."""
    return sum(PROFILES[s.gpu].max_running_requests * s.gpus for s in config.sites)


class CpuSampler:
    """CPU time of every process of each kind over a window, taken by a thread at its two ends.
    The bench's own client processes (its children not named in `kinds`) are the kind `client`."""

    def __init__(self, kinds: dict[str, list[int]]) -> None:
        self.kinds = kinds
        self.window: tuple[float, float] | None = None
        self._thread: threading.Thread | None = None
        self._used: dict[str, tuple[float, float]] = {}
        self.machine_busy_share: float | None = None  # of all this machine's cores, over the window
        self.waits: dict[str, RunqueueWait] = {}  # by kind, over the window (Linux; empty elsewhere)

    def start(self, window: tuple[float, float]) -> None:
        self.window = window
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def used(self) -> dict[str, tuple[float, float]]:
        """(user s, system s) by kind over the window."""
        if self._thread is not None:
            self._thread.join()
        return self._used

    def _sample(self) -> None:
        assert self.window is not None
        time.sleep(max(0.0, self.window[0] - time.monotonic()))
        named = {pid for pids in self.kinds.values() for pid in pids}
        me = psutil.Process()  # a run with one client process drives it from this one
        clients = [me.pid, *(p.pid for p in me.children(recursive=True) if p.pid not in named)]
        procs = {kind: _processes(pids) for kind, pids in {**self.kinds, "client": clients}.items()}
        before, machine_before = {kind: _times(ps) for kind, ps in procs.items()}, psutil.cpu_times()
        waits_before = {kind: _schedstats(ps) for kind, ps in procs.items()}
        time.sleep(max(0.0, self.window[1] - time.monotonic()))
        after, machine_after = {kind: _times(ps) for kind, ps in procs.items()}, psutil.cpu_times()
        waits_after = {kind: _schedstats(ps) for kind, ps in procs.items()}
        self.machine_busy_share = _busy_share(machine_before, machine_after)
        self.waits = {kind: RunqueueWait.between(waits_before[kind], waits_after[kind]) for kind in procs}
        for kind, ps in procs.items():
            user, system = 0.0, 0.0
            for p in ps:
                if p.pid in before[kind] and p.pid in after[kind]:
                    user += after[kind][p.pid][0] - before[kind][p.pid][0]
                    system += after[kind][p.pid][1] - before[kind][p.pid][1]
            self._used[kind] = (user, system)


# (pid, tid) -> the kernel's schedstat of that thread: (ns on a core, ns waiting for one, times run)
Schedstats = dict[tuple[int, int], tuple[int, int, int]]


@dataclasses.dataclass(frozen=True, slots=True)
class RunqueueWait:
    """How long the threads of one kind waited for a core after being woken, over a window, from
    the kernel's per-thread `schedstat` (run ns, runqueue wait ns, times run). On a machine out of
    CPU every hop of a request is a wakeup that waits its turn: this says how long a turn was."""

    run_s: float
    wait_s: float
    wakeups: int

    @classmethod
    def between(cls, before: Schedstats, after: Schedstats) -> RunqueueWait:
        run = wait = runs = 0
        for thread, (run_ns, wait_ns, count) in after.items():
            was = before.get(thread, (0, 0, 0))  # a thread started in the window counts from 0
            run, wait, runs = run + run_ns - was[0], wait + wait_ns - was[1], runs + count - was[2]
        return cls(run / 1e9, wait / 1e9, runs)

    @property
    def us_per_wakeup(self) -> float | None:
        return round(self.wait_s / self.wakeups * 1e6, 1) if self.wakeups else None

    @property
    def share(self) -> float | None:
        """Of the time its threads were runnable, the share spent waiting for a core."""
        total = self.run_s + self.wait_s
        return round(self.wait_s / total, 3) if total else None


def _schedstats(procs: Sequence[psutil.Process]) -> Schedstats:
    """/proc/PID/task/TID/schedstat of every thread of `procs`; empty where the kernel keeps none."""
    out: Schedstats = {}
    for p in procs:
        try:
            threads = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                    run_ns, wait_ns, count = (int(x) for x in f.read().split()[:3])
            except (OSError, ValueError):
                continue  # the thread ended, or no schedstat here
            out[(p.pid, int(tid))] = (run_ns, wait_ns, count)
    return out


def _busy_share(before, after) -> float | None:
    """The share of the machine's CPU time between two psutil.cpu_times() that was not idle."""
    total = sum(after) - sum(before)
    idle = (after.idle + after.iowait) - (before.idle + before.iowait)
    return round(1.0 - idle / total, 3) if total > 0 else None


def _processes(pids: Sequence[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def _times(procs: Sequence[psutil.Process]) -> dict[int, tuple[float, float]]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[p.pid] = (t.user, t.system)
    return out


def _federation_kinds(federation: Federation) -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {
        "gateway": [],
        "agent": [],
        "reader": [],
        "scheduler": [],
        "emulator": [],
        "link": [],
    }
    for child in federation.children:
        kind = child.name.split(" ")[0]
        kinds[kind].append(child.pid)
        if kind == "agent":  # its emulated workers run in processes it started; so do its reporter
            for proc in psutil.Process(child.pid).children(recursive=True):  # and multiprocessing's
                try:  # tracker, which are the agent's, and its readers (--readers), counted apart
                    command = " ".join(proc.cmdline())
                except psutil.Error:  # gone already: nothing of it to measure
                    continue
                own = "agent" if "multiprocessing" in command else "reader" if READER_MODULE in command else "emulator"
                kinds[own].append(proc.pid)
    if not kinds["reader"]:  # an agent without readers (--readers 0, the default)
        del kinds["reader"]
    return kinds


def _agent_us(phase: dict[str, Any]) -> float | None:
    """The agent's CPU per token: its own process's and its readers'."""
    per = phase["cpu_us_per_token"]
    return None if per.get("agent") is None else round(per["agent"] + (per.get("reader") or 0.0), 2)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 3)
    return round(statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1], 3)


def _phase(
    endpoint: str,
    samples: Sequence[Sample],
    args: argparse.Namespace,
    open_requests: int,
    kinds: dict[str, list[int]],
    label: str,
    one_way_ms: dict[str, float],
    stream_interval: int | None = None,
) -> dict[str, Any]:
    sampler = CpuSampler(kinds)
    sustain = scenarios.Sustain(args.warmup_s, args.sustain_s, min(RAMP_S, args.warmup_s / 2), cut_at_end=True)
    results, window = scenarios.run_sustained(
        endpoint, samples, open_requests, sustain, 1.0, label, stream_interval=stream_interval, on_window=sampler.start
    )
    used = sampler.used()
    window_s = window[1] - window[0]
    tokens_per_s = scenarios.window_rate(results, window)
    events_per_s = scenarios.window_rate(results, window, lambda r: r.events)
    in_window = [r for r in results if window[0] <= r.started < window[1]]
    hops = [r.hop_ms - one_way_ms.get(r.site, 0.0) for r in in_window if r.hop_ms is not None]
    routes = [r.route_ms for r in in_window if r.route_ms is not None]
    tpots = [t * 1000 for r in results if (t := r.tpot_s) is not None and r.first_token and r.first_token < window[1]]
    failed = [r for r in results if not r.ok]
    cpu_s = {kind: user + system for kind, (user, system) in used.items()}
    return {
        "tokens_per_s": round(tokens_per_s, 1),
        "client_events_per_s": round(events_per_s, 1),
        "tokens_per_client_event": round(tokens_per_s / events_per_s, 3) if events_per_s else None,
        "cpu_us_per_token": {k: _per(v, tokens_per_s * window_s) for k, v in cpu_s.items()},
        "cpu_us_per_event": {k: _per(v, events_per_s * window_s) for k, v in cpu_s.items()},
        "cpu_cores": {k: round(v / window_s, 3) for k, v in cpu_s.items()},
        "cpu_system_share": {k: round(s / (u + s), 3) if u + s else None for k, (u, s) in used.items()},
        "machine_busy_share": sampler.machine_busy_share,
        "saturated": (sampler.machine_busy_share or 0.0) >= SATURATED_SHARE,
        "processes": {k: len(pids) for k, pids in kinds.items()},  # measured as each kind (not the clients)
        "runqueue_wait_us_per_wakeup": {k: w.us_per_wakeup for k, w in sampler.waits.items()},
        "runqueue_wait_share": {k: w.share for k, w in sampler.waits.items()},
        "overhead_ms_p50": _percentile(hops, 0.5),
        "overhead_ms_p99": _percentile(hops, 0.99),
        "route_ms_p50": _percentile(routes, 0.5),
        "route_ms_p99": _percentile(routes, 0.99),
        "tpot_ms_p50": _percentile(tpots, 0.5),
        "requests": len(results),
        "requests_failed": len(failed),
        "errors": sorted({r.error[:120] for r in failed if r.error})[:5],
        "window_s": round(window_s, 2),
    }


def _per(cpu_s: float, count: float) -> float | None:
    return round(cpu_s / count * 1e6, 2) if count else None


def run(args: argparse.Namespace, samples: Sequence[Sample], config: Config, log: IO[str]) -> dict[str, Any]:
    open_requests = args.max_in_flight or full_batches(config)
    one_way_ms = {s.name: config.rtt_between(s.region, config.gateway.region) / 2 for s in config.sites}
    federation = Federation(config, log, insecure=args.insecure)
    try:
        federation.up()
        endpoint = config.gateway_url + "/v1"
        kinds = _federation_kinds(federation)
        print(f"bench --datapath: {open_requests} open requests on {endpoint}", file=sys.stderr, flush=True)
        phases = {"federation": _phase(endpoint, samples, args, open_requests, kinds, "federation", one_way_ms)}
        phases["federation every event"] = _phase(
            endpoint, samples, args, open_requests, kinds, "federation every event", one_way_ms, stream_interval=1
        )
        workers = {
            s.name: [f"http://{config.host}:{s.worker_port + i}" for i in range(s.gpus)]
            for s in config.sites
            if s.worker_port is not None
        }
        policy = (args.peers or (ROUTER_POLICY,))[0]
        with FlatRouter(config, policy, log=log, worker_urls=workers) as router:
            router_kinds = {
                "router": [c.pid for c in router.children if c.name == "sglang-router"],
                "link": [c.pid for c in router.children if c.name.startswith("link")],
                "emulator": kinds["emulator"],
            }
            phases["sglang-router"] = _phase(router.endpoint, samples, args, open_requests, router_kinds, "router", {})
    finally:
        federation.down()
    ours, peer = phases["federation"], phases["sglang-router"]
    scaled = None
    if args.scale_gateways:
        label = f"federation, {args.scale_gateways} gateway processes"
        scaled = phases[label] = _scaled_out(
            args, samples, config.with_gateway(processes=args.scale_gateways), log, open_requests, one_way_ms, label
        )
    router_us = peer["cpu_us_per_token"].get("router")
    return {
        "benchmark": "datapath",
        "stream_interval": config.stream_interval,
        "tls": not args.insecure,  # mutual TLS on every gRPC hop of the federation's phases
        "speed": config.speed,
        "open_requests": open_requests,
        "sites": {s.name: f"{s.gpus} x {s.gpu}" for s in config.sites},
        "router_policy": policy,
        "tokens_per_s": ours["tokens_per_s"],
        "client_events_per_s": ours["client_events_per_s"],
        "gateway_cpu_us_per_token": ours["cpu_us_per_token"].get("gateway"),
        "agent_cpu_us_per_token": _agent_us(ours),
        "agent_readers_cpu_us_per_token": ours["cpu_us_per_token"].get("reader"),  # of it, its readers'
        "router_cpu_us_per_token": router_us,
        "gateway_over_router": _ratio(ours["cpu_us_per_token"].get("gateway"), router_us),
        "every_event_gateway_cpu_us_per_token": phases["federation every event"]["cpu_us_per_token"].get("gateway"),
        "every_event_agent_cpu_us_per_token": _agent_us(phases["federation every event"]),
        "overhead_ms_p50": ours["overhead_ms_p50"],
        "overhead_ms_p99": ours["overhead_ms_p99"],
        "route_ms_p50": ours["route_ms_p50"],  # of the overhead: until the route was decided
        "route_ms_p99": ours["route_ms_p99"],
        "tpot_ms_p50": ours["tpot_ms_p50"],
        "machine_busy_share": ours["machine_busy_share"],
        "saturated": ours["saturated"],
        "runqueue_wait_us_per_wakeup": ours["runqueue_wait_us_per_wakeup"],
        "gateway_cores_per_100k_tok_s": _cores_per_100k(ours),
        **({"gateway_scaling": _gateway_scaling((ours, scaled))} if scaled else {}),
        "phases": phases,
    }


def _scaled_out(
    args: argparse.Namespace,
    samples: Sequence[Sample],
    config: Config,
    log: IO[str],
    open_requests: int,
    one_way_ms: dict[str, float],
    label: str,
) -> dict[str, Any]:
    """The `federation` phase again, on a federation whose gateway is `config.gateway.processes`
    processes sharing its port (SO_REUSEPORT), each taking the connections the kernel gives it."""
    federation = Federation(config, log, insecure=args.insecure)
    try:
        federation.up()
        return _phase(
            config.gateway_url + "/v1", samples, args, open_requests, _federation_kinds(federation), label, one_way_ms
        )
    finally:
        federation.down()


def _cores_per_100k(phase: dict[str, Any]) -> float | None:
    """The gateway tier's CPU cores for 100 k output tokens/s at this phase's per-token cost."""
    us = phase["cpu_us_per_token"].get("gateway")
    return round(us * 100_000 / 1e6, 3) if us is not None else None


def _gateway_scaling(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One gateway process against several (the federation phase and the scaled-out one), keyed
    by their gateway processes: tokens/s, the gateway tier's CPU per token and its cores, per
    100 k tok/s too, and whether the machine was out of CPU."""
    return {
        str(phase["processes"]["gateway"]): {
            "tokens_per_s": phase["tokens_per_s"],
            "gateway_cpu_us_per_token": phase["cpu_us_per_token"].get("gateway"),
            "gateway_cpu_cores": phase["cpu_cores"].get("gateway"),
            "gateway_cores_per_100k_tok_s": _cores_per_100k(phase),
            "machine_busy_share": phase["machine_busy_share"],
            "saturated": phase["saturated"],
            "requests_failed": phase["requests_failed"],
        }
        for phase in runs
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None
