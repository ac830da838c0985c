"""`fedctl simulate --policy-quality`: the routing policy at a scale this machine cannot run for
real, by a discrete-event simulation over the same GPU models and the real `core/policy.py`
(federation/simulate/des.py says what it simulates and what it leaves out).

Four runs on one world (`--sites` sites over eight regions, clients in every region):
- Offline: each policy keeps the sites full; its efficiency is what it delivers over the sum of
  what each site delivers alone, in the same window (the MLPerf entry's 97 %).
- Server: Poisson arrivals at `--server-load` of that sum; each policy's TTFT at the client,
  round trips included.
- A region lost: every site of the region with the most capacity dies in the Offline window;
  what the rest deliver after it, over what they deliver alone.
- Sites added: eight sites join in the Offline window; how soon they carry their share.

The JSON's keys: `sites`, `regions`, `federation_efficiency`, `round_robin_efficiency`,
`static_efficiency`, `ttft_p99_ms` (per policy), then each run's details.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from core.gpus import PROFILES
from core.work import DEFAULT_EXPECTED_OUTPUT_TOKENS
from federation.simulate.des import Events, Load, Result, Simulation, alone, measured_capacities
from federation.simulate.world import REGIONS, make_sites, rtt_s

FEDERATION, ROUND_ROBIN, STATIC = "least_expected_delay", "round_robin", "static_weights"
ADDED_SITES = 8  # the "8 sites added"
CONVERGED = 0.9  # joined sites have converged once they deliver this share of what they do alone
SMOOTH_S = 5.0  # ... averaged over this long


def main(args: argparse.Namespace) -> int:
    if not 0.0 < args.server_load:
        print("fedctl simulate: --server-load must be > 0", file=sys.stderr)
        return 2
    if len(args.sites) != 1:
        print("fedctl simulate --policy-quality: give one --sites", file=sys.stderr)
        return 2
    started = time.monotonic()
    report = simulate(
        args.sites[0], args.added, args.seed, args.slower_share, args.warmup_s, args.window_s, args.server_load, args.dt
    )
    report["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(_table(report), file=sys.stderr)
    print(text)
    return 0


def simulate(
    count: int,
    added: int,
    seed: int,
    slower_share: float,
    warmup_s: float,
    window_s: float,
    server_load: float,
    dt: float,
) -> dict[str, Any]:
    world = make_sites(count + added, seed, slower_share)
    sites, joining = world[:count], world[count:]
    rtt = rtt_s()
    end = warmup_s + window_s
    window = (warmup_s, end)
    solo = alone(world, rtt, end, seed, dt)
    truth = {s.name: solo.rate(*window, [s.name]) for s in world}
    measured = measured_capacities(truth, seed)
    names = [s.name for s in sites]
    solo_sum = sum(truth[n] for n in names)
    in_flight = sum(PROFILES[s.gpu].max_running_requests * s.gpus for s in sites) * 5 // 4  # full, and a queue

    def run(policy: str, load: Load, events: Events | None = None) -> Result:
        return Simulation(sites, policy, rtt, measured, seed, dt).run(load, end, events)

    offline = {p: run(p, Load(REGIONS, in_flight=in_flight)) for p in (FEDERATION, ROUND_ROBIN, STATIC)}
    rate_per_s = server_load * solo_sum / DEFAULT_EXPECTED_OUTPUT_TOKENS
    server = {p: run(p, Load(REGIONS, rate_per_s=rate_per_s)) for p in (FEDERATION, ROUND_ROBIN, STATIC)}
    report: dict[str, Any] = {
        "sites": count,
        "regions": len(REGIONS),
        "gpus": sum(s.gpus for s in sites),
        "slower_than_declared": sum(1 for s in sites if s.speed < 1.0),
        "simulated_s": {"warmup": warmup_s, "window": window_s, "tick": dt},
        "alone_tok_s": round(solo_sum),
        "federation_efficiency": _efficiency(offline[FEDERATION], window, solo_sum),
        "round_robin_efficiency": _efficiency(offline[ROUND_ROBIN], window, solo_sum),
        "static_efficiency": _efficiency(offline[STATIC], window, solo_sum),
        "ttft_p99_ms": {p: _ms(r.ttft_s(*window, 99)) for p, r in server.items()},
        "ttft_p50_ms": {p: _ms(r.ttft_s(*window, 50)) for p, r in server.items()},
        "server": {
            "load": server_load,
            "rate_per_s": round(rate_per_s, 1),
            "delivered_over_offered": {
                p: round(r.rate(*window) / (server_load * solo_sum), 4) for p, r in server.items()
            },
        },
        "offline": {p: _counts(r) for p, r in offline.items()},
    }
    report["region_lost"] = _region_lost(sites, truth, run, in_flight, warmup_s, window_s)
    report["sites_added"] = _sites_added(sites, joining, truth, rtt, measured, seed, dt, in_flight, warmup_s, window_s)
    return report


def _region_lost(sites, truth, run, in_flight, warmup_s, window_s) -> dict[str, Any]:
    """The region with the most capacity dies a third into the window; measured from 30 s after
    (or half of what is left of the window, if less)."""
    by_region: dict[str, float] = {}
    for s in sites:
        by_region[s.region] = by_region.get(s.region, 0.0) + truth[s.name]
    region = max(by_region, key=lambda r: by_region[r])
    dead = tuple(s.name for s in sites if s.region == region)
    surviving = [s.name for s in sites if s.region != region]
    at = warmup_s + window_s / 3
    end = warmup_s + window_s
    after = (at + min(30.0, (end - at) / 2), end)
    out: dict[str, Any] = {"region": region, "sites_lost": len(dead), "at_s": at}
    for policy in (FEDERATION, ROUND_ROBIN):
        r = run(policy, Load(REGIONS, in_flight=in_flight), Events(fail_at={at: dead}))
        out[policy] = {
            "after_over_surviving": round(r.rate(*after) / sum(truth[n] for n in surviving), 4),
            **_counts(r),
        }
    return out


def _sites_added(sites, joining, truth, rtt, measured, seed, dt, in_flight, warmup_s, window_s) -> dict[str, Any]:
    """Sites join a quarter into the window; how long until they carry their share."""
    at = warmup_s + window_s / 4
    end = warmup_s + window_s
    sim = Simulation(sites, FEDERATION, rtt, measured, seed, dt)
    r = sim.run(Load(REGIONS, in_flight=in_flight), end, Events(join_at={at: tuple(joining)}))
    new = [s.name for s in joining]
    new_truth = sum(truth[n] for n in new)
    converge_s = None
    t = at
    while t + SMOOTH_S <= end:
        if r.rate(t, t + SMOOTH_S, new) >= CONVERGED * new_truth:
            converge_s = round(t + SMOOTH_S - at, 1)
            break
        t += dt
    settled = (at + (converge_s or 0.0) + SMOOTH_S, end)
    every = sum(truth[s.name] for s in (*sites, *joining))
    ratio = r.rate(*settled) / every if settled[1] > settled[0] else math.nan
    return {
        "added": len(new),
        "at_s": at,
        "converge_s": converge_s,
        "throughput_ratio": round(ratio, 4),
        **_counts(r),
    }


def _efficiency(result: Result, window: tuple[float, float], solo_sum: float) -> float:
    return round(result.rate(*window) / solo_sum, 4)


def _counts(r: Result) -> dict[str, int]:
    return {"sent": r.sent, "finished": r.finished, "resumed": r.resumed, "still_served": r.unfinished}


def _ms(seconds: float) -> float | None:
    return round(seconds * 1000.0, 1) if math.isfinite(seconds) else None


def _table(report: dict[str, Any]) -> str:
    lines = [f"{report['sites']} sites, {report['gpus']} GPUs, {report['slower_than_declared']} slower than declared"]
    lines.append(f"{'policy':22} {'Offline efficiency':>18} {'Server TTFT p99 ms':>19}")
    for policy, key in ((FEDERATION, "federation"), (ROUND_ROBIN, "round_robin"), (STATIC, "static")):
        lines.append(f"{policy:22} {report[f'{key}_efficiency']:>18} {report['ttft_p99_ms'][policy]!s:>19}")
    lost = report["region_lost"]
    lines.append(
        f"region {lost['region']} lost: after/surviving {lost[FEDERATION]['after_over_surviving']}"
        f" (round robin {lost[ROUND_ROBIN]['after_over_surviving']})"
    )
    added = report["sites_added"]
    lines.append(f"{added['added']} sites added: converge {added['converge_s']} s, ratio {added['throughput_ratio']}")
    return "\n".join(lines)
