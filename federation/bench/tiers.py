"""`fedctl bench --workload tiers` (issue #46): priority, default and flex work sharing one
federation at 1.5x what it can serve, at per-token pace, with a site crash in the middle.

One federation, two phases on it:
1. Offline, sustained (every finished sample replaced at once, all default): the federation's
   own rate on this workload, what "the federation stays busy" is measured against.
2. Poisson arrivals at `OVERLOAD` x that rate (requests/s from the mean answer, GPU time), each
   sample's tier drawn 20 % priority, 50 % default, 30 % flex (seeded, exact shares). After a
   warm-up and a measured window, the site with the least declared capacity loses its agent
   (SIGKILL, as `fedctl drill site-crash`); arrivals go on for `AFTER_CRASH` of a window more.

Reported, in GPU time: each tier's TTFT p50/p99 and its requests ok, refused (429 with
Retry-After) and failed; the output rate over the overload's window before the crash and its
ratio to Offline's; and for the streams the crash cut, per tier, the gap each saw before its next
token (the resume order: tier by tier, soonest first).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import signal
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.config import Config
from core.tiers import Tier
from federation.bench import scenarios
from federation.bench.client import Result
from federation.bench.workload import Sample
from federation.embedded import Federation
from scheduler.capacity import prior_capacity_tok_s

OVERLOAD = 1.5  # arrivals over what the federation serves (the load)

TIER_SHARES = {Tier.PRIORITY: 0.2, Tier.DEFAULT: 0.5, Tier.FLEX: 0.3}
WARMUP_S = 20.0  # GPU s, each phase: longer than an answer of ~200 tokens lives at full batch
WINDOW_S = 20.0  # GPU s, each phase's measured window
AFTER_CRASH = 0.75  # of the window: arrivals go on this long after the crash (the cut streams resume meanwhile)
# The bars, GPU time.
PRIORITY_TTFT_P99_MS = 2000.0
STEADY_OVER_OFFLINE = 0.97


def tiered(samples: Sequence[Sample], count: int, seed: int) -> list[Sample]:
    """`count` samples cycling through `samples`, each a new index, their tiers in TIER_SHARES'
    exact shares, in a seeded order."""
    tiers = [tier for tier, share in TIER_SHARES.items() for _ in range(round(share * count))]
    tiers += [Tier.DEFAULT] * (count - len(tiers))
    random.Random(seed).shuffle(tiers)
    return [
        dataclasses.replace(samples[i % len(samples)], index=i, service_tier=tier.label)
        for i, tier in enumerate(tiers[:count])
    ]


def run(args: argparse.Namespace, samples: Sequence[Sample], config: Config, log_path: Path) -> dict[str, Any]:
    speed = config.speed
    warmup_s, window_s = args.warmup_s or WARMUP_S, args.sustain_s or WINDOW_S
    crashed = min(config.sites, key=lambda s: prior_capacity_tok_s(s.gpu, s.gpus)).name
    with log_path.open("a") as log:
        federation = Federation(config, log)
        try:
            federation.up()
            endpoint = config.gateway_url + "/v1"
            sustain = scenarios.Sustain(warmup_s, window_s, cut_at_end=True)
            results, window = scenarios.run_sustained(endpoint, samples, args.max_in_flight, sustain, speed, "offline")
            offline = scenarios.window_rate(results, window) / speed
            mean_answer = statistics.fmean(s.output_tokens for s in samples)
            rate = OVERLOAD * offline / mean_answer  # requests/s, GPU time
            count = round(rate * (warmup_s + window_s * (1 + AFTER_CRASH)))
            plan = scenarios.server_plan(
                tiered(samples, count, args.seed), rate, speed=speed, seed=args.seed, max_in_flight=args.max_in_flight
            )
            start = plan[0].due or time.monotonic()
            crash_at = start + (warmup_s + window_s) / speed
            agent = federation.child(f"agent {crashed}").proc
            crash = threading.Timer(max(0.0, crash_at - time.monotonic()), agent.send_signal, (signal.SIGKILL,))
            crash.start()
            try:
                overload = scenarios.run_plan(endpoint, plan, args.max_in_flight, "tiers")
            finally:
                crash.cancel()
        finally:
            federation.down()
    steady = scenarios.window_rate(overload, (start + warmup_s / speed, crash_at)) / speed
    tier_of = {p.sample.index: Tier.named(p.sample.service_tier or "default") for p in plan}
    return report(overload, tier_of, speed, Rates(offline, steady, rate), Crash(crashed, crash_at, crash_at - start))


@dataclasses.dataclass(frozen=True, slots=True)
class Rates:
    offline: float  # output tokens/s, GPU time: the sustained Offline phase's
    steady: float  # and the overload's, over its window before the crash
    arrivals: float  # the overload's requests/s, GPU time


@dataclasses.dataclass(frozen=True, slots=True)
class Crash:
    site: str
    at: float  # time.monotonic()
    after_s: float  # from the overload's first arrival, wall s


def report(
    results: Sequence[Result], tier_of: dict[int, Tier], speed: float, rates: Rates, crash: Crash
) -> dict[str, Any]:
    """The issue's JSON: `tiers`, `steady_output_tokens_per_s`, and the crash's resume order."""
    by_tier: dict[Tier, list[Result]] = {tier: [] for tier in Tier}
    for r in results:
        by_tier[tier_of[r.index]].append(r)
    tiers = {tier.label: _tier(rs, speed) for tier, rs in by_tier.items()}
    resumes = {tier.label: _resumes(rs, crash, speed) for tier, rs in by_tier.items()}
    resumed = [label for label in resumes if resumes[label]["gap_p50_ms"] is not None]
    order = sorted(resumed, key=lambda label: resumes[label]["gap_p50_ms"])
    offline, steady = rates.offline, rates.steady
    priority, flex = tiers["priority"], tiers["flex"]
    return {
        "workload": "tiers",
        "overload": OVERLOAD,
        "shares": {tier.label: share for tier, share in TIER_SHARES.items()},
        "arrivals_per_s": round(rates.arrivals, 2),
        "offline_output_tokens_per_s": round(offline, 1),
        "steady_output_tokens_per_s": round(steady, 1),
        "steady_over_offline": round(steady / offline, 4) if offline else 0.0,
        "tiers": tiers,
        "crash": {
            "site": crash.site,
            "after_s": round(crash.after_s * speed, 2),
            "resumes": resumes,
            "resume_order": order,
        },
        "speed": speed,
        "meets": {
            "priority": priority["ttft_p99_ms"] is not None
            and priority["ttft_p99_ms"] <= PRIORITY_TTFT_P99_MS
            and priority["refused"] == priority["failed"] == 0,
            "flex": flex["failed"] == 0,
            "steady": offline > 0 and steady / offline >= STEADY_OVER_OFFLINE,
            "priority_resumed_first": bool(order) and order[0] == "priority",
        },
    }


def _tier(results: Sequence[Result], speed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.first_token - r.started for r in ok if r.first_token is not None]
    return {
        "ttft_p50_ms": scenarios.percentile_ms(ttfts, 0.5, speed),
        "ttft_p99_ms": scenarios.percentile_ms(ttfts, 0.99, speed),
        "requests_ok": len(ok),
        "refused": sum(r.refused for r in results),  # 429 with Retry-After
        "failed": sum(not r.ok and not r.refused for r in results),
    }


def _resumes(results: Sequence[Result], crash: Crash, speed: float) -> dict[str, Any]:
    """The streams the crash cut (begun at its site, their first token before it, not ended by
    then) and the wait each saw for its next token, which spans the crash."""
    cut = [
        r
        for r in results
        if r.site == crash.site and r.first_token is not None and r.first_token < crash.at < r.finished
    ]
    gaps = [r.longest_gap_s for r in cut if r.ok and r.longest_gap_end is not None and r.longest_gap_end > crash.at]
    return {
        "cut": len(cut),
        "resumed": len(gaps),
        "gap_p50_ms": scenarios.percentile_ms(gaps, 0.5, speed),
        "gap_p99_ms": scenarios.percentile_ms(gaps, 0.99, speed),
    }
