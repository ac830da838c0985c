"""`fedctl simulate --sites N`: the real scheduler replicas (processes, gRPC, mutual TLS) under
the reports of N simulated sites and the Route load of G gateways, on this machine.

Per N, in order:
1. a throwaway CA issues the replicas', the gateways' and every site's certificate;
2. `--replicas` scheduler processes start, as `fedctl up` starts them;
3. `--agent-processes` processes (federation/simulate/agents.py) host the sites, mixed MI300X /
   MI355X of 8-16 GPUs over eight regions (federation/simulate/world.py): each registers and
   reports to every replica at the cadence it is told, from its GPU model running what it is sent;
4. one process (federation/simulate/gateways.py) runs `--gateways` copies of the gateway's own
   scheduler client, routing `--routes-per-s` in all and watching the state as gateways do;
5. after `--warmup-s`, REPORTS_ONLY_S is measured on the replica the gateways will route to under
   the sites' reports alone (its CPU, the reports it applied); then routes start, and after a
   warm-up `--window-s` is measured: its CPU, RSS, reports, the routes it answered and how long
   each took at the gateway, and how old each pushed state was when a gateway got it;
6. a site is killed (its connections close) and, 2 s later, another falls silent: how long
   until every gateway sees each down;
7. the replica the gateways route to is killed: how long routes wait, and whether any is lost.

The JSON keys (per N; `runs` when several N are given): `sites`, `routes_per_s`,
`route_ms_p50`, `route_ms_p99`, `reports_per_s`, `scheduler_cpu_cores`, `scheduler_rss_mb`,
`watch_fanout_ms_p99`, `detect_down_s`, `replica_failover_s`, then the details. This machine runs
the simulated sites and gateways beside the replica: `machine_busy` says how much of its cores
the run took, since a replica that must share them answers later than one alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import ssl
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from core import processes
from core.metrics_endpoint import client_ssl_context
from core.pki import GATEWAY, SCHEDULER, Identity, Role
from federation.simulate.gateways import DEGRADED, LOST, ROUTED
from federation.simulate.world import REGIONS, make_sites, rtt_s
from federation.throwaway_ca import ThrowawayCa

REPORTS_ONLY_S = 10.0  # the replica's cost of the sites' reports alone is measured this long (at most the window) ...
ROUTES_WARMUP_S = 3.0  # ... then routes start, and are measured after this long
SILENCE_AFTER_S = 2.0  # the silenced site goes quiet this long after the killed one ...
DETECT_WAIT_S = 3.0  # ... and each is given this long to be seen down
FAILOVER_WAIT_S = 5.0  # after a replica is killed, routes are watched this long
STOP_TIMEOUT_S = 60.0  # the gateways' process writes every route it recorded when it stops
START_TIMEOUT_S = 600.0  # a thousand sites register two thousand TLS connections before they serve


def run(args: argparse.Namespace) -> int:
    runs = [measure(count, args) for count in args.sites]
    report = runs[0] if len(runs) == 1 else {"runs": runs}
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    if args.png:
        draw(runs, args.png)
    print(table(runs), file=sys.stderr)
    print(text)
    return 0


def measure(count: int, args: argparse.Namespace) -> dict[str, Any]:
    world = make_sites(count, args.seed, args.slower_share)
    with tempfile.TemporaryDirectory(prefix="fedctl-simulate-") as tmp:
        root = Path(tmp)
        ca = ThrowawayCa(root / "tls", "127.0.0.1")
        for identity in (SCHEDULER, GATEWAY, *(Identity(Role.SITE, s.name) for s in world)):
            ca.flags(identity)  # issued now, read by the processes from the directory
        world_file = root / "world.json"
        world_file.write_text(json.dumps([dataclasses.asdict(s) for s in world]))
        base = processes.free_port_block(2 * args.replicas + args.agent_processes)
        logs = (root / "logs").open("w")
        children: list[processes.Child] = []
        try:
            replicas = [_replica(f"replica-{i}", ca, base + 2 * i, logs) for i in range(args.replicas)]
            children += replicas
            addresses = ",".join(r.ready["scheduler"] for r in replicas)
            agents = _agents(args, world_file, addresses, ca, base + 2 * args.replicas, len(world), root, logs)
            children += agents
            watch = f"{world[0].name},{world[1].name}"
            gateways = processes.spawn_python(
                "gateways",
                "federation.simulate.gateways",
                [
                    "--world",
                    str(world_file),
                    "--schedulers",
                    addresses,
                    "--tls-dir",
                    str(ca.directory),
                    "--gateways",
                    str(args.gateways),
                    "--rate",
                    str(args.routes_per_s),
                    "--route-gather-ms",
                    str(args.route_gather_ms),
                    "--watch-sites",
                    watch,
                    "--out",
                    str(root / "gateways.json"),
                ],
                log=logs,
            )
            children.append(gateways)
            processes.wait_ready(gateways, START_TIMEOUT_S)
            report = _phases(args, replicas, agents, gateways, ca)
        finally:
            exits = {child.name: child.stop(STOP_TIMEOUT_S) for child in reversed(children)}
            logs.close()
        missing = [n for n in ("gateways", *(c.name for c in agents)) if exits.get(n) != 0]
        if missing:
            tail = (root / "logs").read_text()[-3000:]
            raise RuntimeError(f"simulated processes failed (exit codes {exits}); the end of their log:\n{tail}")
        routes = json.loads((root / "gateways.json").read_text())
        events = {}
        for i in range(len(agents)):
            events.update(json.loads((root / f"agents-{i}.json").read_text()))
        return _summary(count, world, args, report, routes, events)


def _replica(name: str, ca: ThrowawayCa, port: int, logs) -> processes.Child:
    regions = REGIONS
    rtt = rtt_s(regions)
    flags = [f"--rtt-ms={a}:{b}={rtt[(a, b)] * 1000:g}" for a in regions for b in regions if a <= b]
    return processes.start_python(
        name,
        "scheduler",
        ["--port", str(port), "--metrics-port", str(port + 1), *flags, *ca.flags(SCHEDULER)],
        log=logs,
    )


def _agents(args, world_file: Path, addresses: str, ca: ThrowawayCa, port: int, count: int, root: Path, logs):
    per = math.ceil(count / args.agent_processes)
    children = []
    for i in range(args.agent_processes):
        first = i * per
        if first >= count:
            break
        children.append(
            processes.spawn_python(
                f"agents-{i}",
                "federation.simulate.agents",
                [
                    "--world",
                    str(world_file),
                    "--first",
                    str(first),
                    "--count",
                    str(min(per, count - first)),
                    "--schedulers",
                    addresses,
                    "--tls-dir",
                    str(ca.directory),
                    "--port",
                    str(port + i),
                    "--out",
                    str(root / f"agents-{i}.json"),
                ],
                log=logs,
            )
        )
    for child in children:
        processes.wait_ready(child, START_TIMEOUT_S)
    return children


def _phases(args, replicas, agents, gateways, ca: ThrowawayCa) -> dict[str, Any]:
    """Warm-up on the sites' reports alone, REPORTS_ONLY_S measured so, then the routes: a warm-up
    and the measured window; a site killed and one silenced; the routed replica killed."""
    target = replicas[0]  # every gateway asks the first replica while it answers
    proc = psutil.Process(target.pid)
    context = client_ssl_context(ca.operator.creds)
    metrics_url = target.ready["metrics"]

    def sample() -> tuple[float, dict[str, float], float]:
        return _cpu_s(proc), _scrape(metrics_url, context), time.time()

    time.sleep(args.warmup_s)
    quiet = sample()
    time.sleep(min(REPORTS_ONLY_S, args.window_s))
    quiet_end = sample()
    os.kill(gateways.pid, signal.SIGUSR1)
    time.sleep(ROUTES_WARMUP_S)
    machine = psutil.cpu_times()
    every = [*replicas, *agents, gateways]
    cpu_of = {c.name: _cpu_s(psutil.Process(c.pid)) for c in every}
    (cpu, scraped, start) = sample()
    time.sleep(args.window_s)
    (cpu_end, scraped_end, end) = sample()
    per_process = {c.name: round((_cpu_s(psutil.Process(c.pid)) - cpu_of[c.name]) / (end - start), 3) for c in every}
    busy = _busy_share(machine, psutil.cpu_times())
    rss_mb = proc.memory_info().rss / 1024**2
    os.kill(agents[0].pid, signal.SIGUSR1)
    time.sleep(SILENCE_AFTER_S)
    os.kill(agents[0].pid, signal.SIGUSR2)
    time.sleep(DETECT_WAIT_S)
    killed_at = None
    if len(replicas) > 1:  # a replica's failover needs another to fail over to
        killed_at = time.time()
        target.proc.kill()
        time.sleep(FAILOVER_WAIT_S)
    reports = "federation_scheduler_reports_total"
    return {
        "window": (start, end),
        "scheduler_cpu_cores": (cpu_end - cpu) / (end - start),
        "reports_only_cpu_cores": (quiet_end[0] - quiet[0]) / (quiet_end[2] - quiet[2]),
        "reports_only_per_s": (quiet_end[1][reports] - quiet[1][reports]) / (quiet_end[2] - quiet[2]),
        "scheduler_rss_mb": rss_mb,
        "reports": scraped_end[reports] - scraped[reports],
        "routes_answered": scraped_end["routes"] - scraped["routes"],
        "machine_busy": busy,
        "process_cpu_cores": per_process,
        "replica_killed_at": killed_at,
    }


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _busy_share(before, after) -> float:
    idle = (after.idle + after.iowait) - (before.idle + before.iowait)
    total = sum(after) - sum(before)
    return 1.0 - idle / total if total > 0 else 0.0


def _scrape(url: str, context: ssl.SSLContext) -> dict[str, float]:
    """The replica's report count and its routes answered (summed over sites and outcomes)."""
    with urllib.request.urlopen(url, context=context, timeout=10) as response:
        text = response.read().decode()
    out = {"federation_scheduler_reports_total": 0.0, "routes": 0.0}
    for line in text.splitlines():
        if line.startswith("federation_scheduler_reports_total "):
            out["federation_scheduler_reports_total"] = float(line.split()[1])
        elif line.startswith("federation_scheduler_routes_total{"):
            out["routes"] += float(line.rsplit(" ", 1)[1])
    return out


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def _summary(count, world, args, report, routes, events) -> dict[str, Any]:
    start, end = report["window"]
    window_s = end - start
    asked, took, outcome = routes["asked_at"], routes["took_s"], routes["outcome"]
    in_window = [i for i, t in enumerate(asked) if start <= t < end]
    latencies_ms = [took[i] * 1000.0 for i in in_window if outcome[i] == ROUTED]
    fanout_ms = [age * 1000.0 for at, age in routes["pushes"] if start <= at < end]
    killed_at = report["replica_killed_at"]
    after_kill = [] if killed_at is None else [i for i, t in enumerate(asked) if t + took[i] >= killed_at]
    waits = [took[i] for i in after_kill]

    def detected(event: str) -> float | None:
        """Until every gateway saw the site down (None: not all did)."""
        happened = events.get(event)
        if happened is None:
            return None
        seen = routes["down_seen"].get(happened["site"], [])
        return round(max(seen) - happened["at_unix_s"], 3) if len(seen) == args.gateways else None

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {
        "sites": count,
        "gpus": sum(s.gpus for s in world),
        "regions": len({s.region for s in world}),
        "replicas": args.replicas,
        "gateways": args.gateways,
        "asked_routes_per_s": args.routes_per_s,
        "routes_per_s": round(len(latencies_ms) / window_s, 1),
        "routes_answered_per_s": round(report["routes_answered"] / window_s, 1),
        "route_ms_p50": ms(_percentile(latencies_ms, 50)),
        "route_ms_p99": ms(_percentile(latencies_ms, 99)),
        "reports_per_s": round(report["reports"] / window_s, 1),
        "scheduler_cpu_cores": round(report["scheduler_cpu_cores"], 3),
        "reports_only_cpu_cores": round(report["reports_only_cpu_cores"], 3),
        "reports_only_per_s": round(report["reports_only_per_s"], 1),
        # The replica's CPU per thousand routes a second, beyond what the reports cost: what a
        # rate this machine cannot offer beside the simulated sites and gateways would cost it.
        "cpu_cores_per_1000_routes_per_s": round(
            1000
            * (report["scheduler_cpu_cores"] - report["reports_only_cpu_cores"])
            / max(1.0, len(latencies_ms) / window_s),
            3,
        ),
        "scheduler_rss_mb": round(report["scheduler_rss_mb"], 1),
        "watch_fanout_ms_p99": ms(_percentile(fanout_ms, 99)),
        "watch_fanout_ms_p50": ms(_percentile(fanout_ms, 50)),
        "detect_down_s": detected("crashed"),
        "detect_silent_s": detected("silenced"),
        "replica_failover_s": round(max(waits), 3) if waits else None,
        "routes_lost_in_failover": sum(1 for i in after_kill if outcome[i] == LOST),
        "routes_degraded_in_failover": sum(1 for i in after_kill if outcome[i] == DEGRADED),
        "routes_lost": sum(1 for o in outcome if o == LOST),
        "routes_lost_because": routes["lost_because"],
        "routes_asked": len(outcome),
        "route_gather_ms": args.route_gather_ms,
        # RouteStream messages carry the routes asked within ROUTE_GATHER_S of each other together
        "routes_per_message": round(len(outcome) / routes["route_messages"], 2) if routes["route_messages"] else None,
        "machine_busy": round(report["machine_busy"], 3),
        "process_cpu_cores": report["process_cpu_cores"],  # each process of the run, in the window
        "window_s": round(window_s, 1),
    }


def table(runs: list[dict[str, Any]]) -> str:
    keys = (
        "sites",
        "routes_per_s",
        "route_ms_p50",
        "route_ms_p99",
        "reports_per_s",
        "scheduler_cpu_cores",
        "scheduler_rss_mb",
        "watch_fanout_ms_p99",
        "detect_down_s",
        "detect_silent_s",
        "replica_failover_s",
        "routes_lost",
        "machine_busy",
    )
    lines = ["  ".join(f"{k:>14.14}" for k in keys)]
    lines += ["  ".join(f"{r[k]!s:>14.14}" for k in keys) for r in runs]
    return "\n".join(lines)


def draw(runs: list[dict[str, Any]], path: Path) -> None:
    """The curves: each measure against the number of sites."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("route_ms_p99", "route p99 (ms, at the gateway)"),
        ("scheduler_cpu_cores", "scheduler CPU (cores)"),
        ("reports_per_s", "reports applied / s"),
        ("watch_fanout_ms_p99", "pushed state's age p99 (ms)"),
        ("scheduler_rss_mb", "scheduler RSS (MB)"),
        ("detect_down_s", "site down seen by every gateway (s)"),
    )
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    sites = [r["sites"] for r in runs]
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        ax.plot(sites, [r[key] if r[key] is not None else math.nan for r in runs], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sites, [str(s) for s in sites])
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle(f"One scheduler replica under N simulated sites, {runs[0]['asked_routes_per_s']:g} routes/s asked")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
