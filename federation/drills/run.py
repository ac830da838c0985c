"""`fedctl drill SCENARIO`: a fault under load, and proof of what it cost.

Starts the embedded default (slowed as `fedctl bench` slows it, every worker's port pinned so
faults can reach them), keeps it loaded in a closed loop (every finished request replaced at
once, as a busy fleet is; a failed one after a back-off, as a user's client backs off),
injects the scenario's fault after a warm-up, and measures what the clients saw: requests
failed and lost, the gateway's retries and resumed streams, how soon the fault was detected
and throughput recovered, and throughput before, during and after. With `--endpoint` it
drills a federation already running instead, broken by the operator's `--inject`/`--heal`
commands (see `target.py`), and measures the same.

`recovery_s`: seconds from the fault until throughput, averaged over 3 s, is back to 90 % of
what the surviving capacity delivered before it (a crashed site's share gone, a browned-out
site's divided by 4, ...). `share_target`: the site's part of the capacity the schedulers measure
after the fault; `share_converge_s`: seconds until its share of the tokens is within 10 % of
that, held for 3 s. `capacity_converge_s` (brownout, worker loss): seconds until the site's
measured capacity is within 10 % of its true one (what it measured before, ÷ the slowdown or
× 12/16). Times are wall seconds (the control plane is not slowed by `--speed`), but for
add-site's `converge_s` (see `_joined`); rates, capacities and TTFT are GPU time, as `fedctl
bench` reports them.

The estimator against the truth (the embedded default only: `federation/bench/truth.py` says
what a site's truth is). `capacity_error`: {site: {mean, max, bins}}, the relative error
|estimate − truth| / truth of the site's measured capacity, one value per one-second bin,
over the before window and from 10 s after the fault to the end of the load, in bins where
the schedulers had the site READY throughout and its truth is above 0 (a site with no such
bin is left out); each site's truth is on the mix it completed in that window; the fault
changes the hit site's truth by its `capacity_factor` (a
partition until its heal; an added site has one from the fault). `capacity_truth_before` and
`capacity_truth_after`: each site's truth, averaged as `capacity_before`/`capacity_after`
are. With `--endpoint` the truth is unknown: `capacity_error` is null and
`capacity_error_note` says so. `after_over_surviving`: `output_tokens_per_s_after` ÷
`surviving_tokens_per_s`, how much of what survived the fault the federation delivered.

cpu-starve adds the starved site's share of the tokens before and after the fault
(`site_share_before`, `site_share_after`), its `site_capacity_error`, how many times its
agent was stopped (`agent_stops`) and its process's state once the starving ended
(`agent_status_after`, psutil's: never "stopped"). Its `detection_s` is an overreaction:
when the schedulers stopped having the site READY (null: they never did).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil

from core import mtls, pki, runtime
from core.config import Config, ConfigError
from core.pki import PkiError
from federation import admin
from federation.bench import scenarios
from federation.bench.client import Result
from federation.bench.run import bench_config
from federation.bench.truth import TruthLine, site_truth_tok_s, site_workloads, workload_of
from federation.bench.workload import MLPERF_LIKE_PROMPTS, SHORT_OUTPUTS, LengthDistribution, Sample, WorkloadSpec
from federation.drills import key_quota, timeline
from federation.drills.dashboard_marks import DashboardMarks
from federation.drills.faults import (
    BROWNOUT_FACTOR,
    JOINING_REGION,
    SCENARIOS,
    STARVE_MS,
    STARVE_PERIOD_MS,
    CpuStarve,
    Fault,
    SiteBrownout,
    SiteJoin,
    WorkerLoss,
    poll_until,
)
from federation.drills.sampler import SiteTokenSampler, gateway_counters
from federation.drills.target import DrillError, DrillRefused, Target
from federation.embedded import Federation
from scheduler.workload import Workload

# 32 emulated GPUs and ~18 k open streams at SGLang's per-token pace: at a twentieth of real
# speed (~13 k tokens/s) they leave this machine's cores room to fail over (what each token
# costs across the processes: docs/BENCHMARKS.md, "SGLang's per-token pace").
DRILL_SPEED = 0.05
# Enough open requests to keep every slot of the surviving US site busy (16,384) with room,
# and under one gateway process's 20,000 file descriptors.
DRILL_OPEN_REQUESTS = 18_000
# add-site: more than every slot once the new site is in (4,096 + 16,384 + 8 x 1,024 = 28,672),
# or the federation would not need it to deliver the sum of its parts.
ADD_SITE_OPEN_REQUESTS = 32_000
GATEWAY_STREAMS_PER_PROCESS = 18_000  # each open request holds a socket; the fd limit is 20,000
# Wall seconds of load before the fault, measured before it, and of load after it. The warm-up
# is the ramp (half of it) and then an answer's lifetime at full load (~23 GPU-s at the US site,
# ~470 s of wall time at DRILL_SPEED), so the window before sees the mix a long run would, not
# the ramp's cohort. The window before spans ~25 passes of every worker (a pass at full batch is
# ~2.4 s of wall time at DRILL_SPEED), so its rate is not one pass's burst. The window after
# spans the resume wave a fault sets off (the streams it cut re-prefill their prompts and what
# they had said, while the federation delivers well below its capacity; the drills' timelines in
# docs/BENCHMARKS.md show how long) and five times that again, so that it measures what the
# federation delivers once failed over, not only that wave (docs/CAPACITY.md).
DRILL_WINDOWS_S = (600.0, 60.0, 300.0)
# add-site: the new site's share must converge and hold, which at a twentieth of real speed takes
# minutes of wall time (docs/BENCHMARKS.md, "A site joins under load"); its acceptance
# (throughput_ratio, converge_s) is what the defaults run.
ADD_SITE_WINDOWS_S = (700.0, 100.0, 700.0)


@dataclass(frozen=True, slots=True)
class DrillDefaults:
    """What a drill runs with unless told otherwise."""

    speed: float = DRILL_SPEED
    open_requests: int = DRILL_OPEN_REQUESTS
    windows_s: tuple[float, float, float] = DRILL_WINDOWS_S
    gpus: dict[str, int] | None = None  # the embedded default's sites with this many GPUs (None: 16 each)


DEFAULTS = {
    "add-site": DrillDefaults(open_requests=ADD_SITE_OPEN_REQUESTS, windows_s=ADD_SITE_WINDOWS_S),
    # A slowed step is seen only once it outlasts a normal one, which at a twentieth of real
    # speed takes over a second of wall time (a full MI355X step with these answers is ~0.12 s
    # of GPU time). So the brownout runs the embedded default's shape at half speed (a step of
    # ~0.24 s), with the GPUs this machine can emulate there (as `fedctl bench --datapath` and
    # docs/configs/small-federation.yaml), every slot busy (1,536) and a queue.
    "site-brownout": DrillDefaults(
        speed=0.5, open_requests=2_000, windows_s=(120.0, 20.0, 60.0), gpus={"kr-mi300x": 2, "us-mi355x": 1}
    ),
    # The default's shape, as the other drills: what a starve takes from the agent is wall time,
    # which --speed does not stretch, and the control plane that could misread it (reports every
    # 0.25 s, heartbeats, the estimator's 5-s windows) runs in wall time too; the default's load
    # keeps the starved agent relaying every second of it, with a queue.
    "cpu-starve": DrillDefaults(),
    # A quarter of the US site's GPUs lost cuts ~3,800 streams, each of which re-prefills its prompt
    # and what it had said (~1,150 tokens) wherever it resumes: ~4.3 M tokens, which cost the
    # surviving GPUs about what the whole federation delivers in 2.5 GPU-s, at either site
    # (prefill costs Korea's MI300X 3x what it costs an MI355X, and so does decode): a sixth of
    # the default window after (15 GPU-s). So the window after is twice that: it measures what the
    # federation delivers once failed over, the wave a twelfth of it (docs/BENCHMARKS.md, "Drills").
    "worker-loss": DrillDefaults(windows_s=(DRILL_WINDOWS_S[0], DRILL_WINDOWS_S[1], 2 * DRILL_WINDOWS_S[2])),
}


# `--quick`, for a first look (the README's tour): the brownout's small shape, with a load that
# fills the sites' slots without a long queue, so that an answer lives seconds and the whole
# drill takes about two minutes. Its numbers say that nothing is lost, not what the federation
# delivers: the defaults measure that.
QUICK = DrillDefaults(speed=0.5, open_requests=600, windows_s=(30.0, 15.0, 45.0), gpus={"kr-mi300x": 2, "us-mi355x": 1})


def defaults_for(scenario: str, quick: bool = False) -> DrillDefaults:
    return QUICK if quick else DEFAULTS.get(scenario, DrillDefaults())


# The site hit (added, for add-site); any other drill: the remote one.
DEFAULT_SITE = {
    "site-brownout": "us-mi355x",
    "worker-loss": "us-mi355x",
    "add-site": "eu-mi355x",
    "cpu-starve": "us-mi355x",
}
REMOTE_SITE = "kr-mi300x"
KEY_QUOTA = "key-quota"  # not a site's fault: one key over its limit across regions (key_quota.py)
DETECTION_TIMEOUT_S = 30.0
RECOVERY_LEVEL = 0.9
SETTLE_S = 5.0  # after a heal, the healed site re-registers and is routed to again
DURING_S = 10.0  # "during" the fault: its first seconds (or half the time after it, if shorter)
ROUTE_IN_TRANSIT_S = 0.5  # a route decided just before the fault was seen may still arrive after it
WITHIN = 0.10  # a share (or an estimate) has followed capacity when within 10 % of its target
# capacity_error counts from this long after the fault: the estimator's time constant is 5 s,
# ~95 % of a change followed in three of them; this is where a settled estimate is asked for.
ESTIMATE_SETTLE_S = 10.0
NO_TRUTH = "unknown: --endpoint drills an operator's federation, whose GPUs' truth the drill cannot know"


EPILOG = """\
key-quota drives one key at 3x its --limit-tpm through 2 regions x 2 gateways, kills the
second region's quota store (Redis) for a while, then cuts the regions apart for --partition-s;
its JSON: limit_tokens_per_min, delivered_tokens_per_min_max, overspend_ratio,
partitioned_overspend_ratio, lease_tokens (docs/QUOTAS.md).

cpu-starve stops the site's agent (SIGSTOP) for --starve-ms of every --starve-period-ms, from
the fault to the end of the load, and always lets it run again (SIGCONT); its GPUs lose
nothing. With --endpoint, --inject must start the starving in the background and stop it itself.

The estimator against the truth (embedded default only; with --endpoint the truth is unknown):
  capacity_error        {site: {mean, max, bins}}: |estimate - truth| / truth of the schedulers'
                        capacity for the site, per 1-s bin in which they had it READY, over the
                        before window and from 10 s after the fault to the end of the load.
                        truth = the site's GPUs x the emulator's full-batch tok/s on the mix
                        of prompts and answers it completed (before the fault, and from 10 s
                        after it; GPU time); from the fault, the hit site's x what the fault
                        leaves of it (worker loss 12/16, brownout 1/slowdown, crash 0; a
                        partition until its heal). null with --endpoint (capacity_error_note)
  capacity_truth_before, capacity_truth_after
                        each site's truth (GPU tok/s), averaged as capacity_before/_after are
  after_over_surviving  output_tokens_per_s_after / surviving_tokens_per_s
cpu-starve also reports site_share_before/_after (the starved site's share of the tokens),
site_capacity_error, agent_stops and agent_status_after (never "stopped"); its detection_s is
when the schedulers stopped having the site READY (null: never, as it should be).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog, p.formatter_class = EPILOG, argparse.RawDescriptionHelpFormatter
    p.add_argument("scenario", choices=sorted([*SCENARIOS, KEY_QUOTA]))
    p.add_argument(
        "--site", default=None, help="the site hit (default: kr-mi300x; us-mi355x for brownout/loss/cpu-starve)"
    )
    p.add_argument("--config", type=Path, default=None)
    p.add_argument(
        "--endpoint",
        default=None,
        help="drill this running federation's gateway (http://host:port) instead of starting the embedded default",
    )
    p.add_argument(
        "--scheduler",
        action="append",
        default=None,
        help="with --endpoint: a scheduler replica's host:port, repeatable (default: those the gateway's /health names)",
    )
    p.add_argument(
        "--inject",
        default=None,
        metavar="CMD",
        help="with --endpoint: the shell command that causes the fault (FEDCTL_DRILL_SITE names the site)",
    )
    p.add_argument(
        "--heal",
        default=None,
        metavar="CMD",
        help="with --endpoint: run --heal-after-s after the fault (site-partition: heal; scheduler-crash: kill the rest)",
    )
    mtls.add_arguments(p, "operator")  # with --endpoint
    p.add_argument(
        "--speed",
        type=runtime.positive_float,
        default=None,
        help=f"GPU speed (default {DRILL_SPEED} for the embedded default, site-brownout 0.5; 1 for --endpoint)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a two-minute drill on 2 MI300X + 1 MI355X at half speed: shows the fault and that nothing is "
        "lost (not add-site; the defaults measure the federation)",
    )
    p.add_argument(
        "--open-requests",
        type=runtime.positive_int,
        default=None,
        help=f"default {DRILL_OPEN_REQUESTS:,}; add-site: {ADD_SITE_OPEN_REQUESTS:,}; site-brownout: "
        f"{DEFAULTS['site-brownout'].open_requests:,}",
    )
    windows = f"defaults {DRILL_WINDOWS_S}; add-site: {ADD_SITE_WINDOWS_S}; site-brownout: {DEFAULTS['site-brownout'].windows_s}"
    p.add_argument(
        "--warmup-s", type=runtime.positive_float, default=None, help=f"wall s of load before measuring ({windows})"
    )
    p.add_argument("--before-s", type=runtime.positive_float, default=None, help="wall s measured before the fault")
    p.add_argument("--after-s", type=runtime.positive_float, default=None, help="wall s of load after the fault")
    p.add_argument(
        "--heal-after-s", type=runtime.positive_float, default=20.0, help="partition: heal; scheduler-crash: kill all"
    )
    p.add_argument(
        "--slowdown", type=runtime.positive_float, default=BROWNOUT_FACTOR, help="site-brownout: how much slower"
    )
    p.add_argument(
        "--starve-ms",
        type=runtime.positive_float,
        default=STARVE_MS,
        help="cpu-starve: the agent stopped (SIGSTOP) this long of every --starve-period-ms",
    )
    p.add_argument(
        "--starve-period-ms",
        type=runtime.positive_float,
        default=STARVE_PERIOD_MS,
        help="cpu-starve: every this long, the agent is stopped --starve-ms, then continued (SIGCONT)",
    )
    p.add_argument(
        "--stream-interval",
        type=runtime.positive_int,
        default=1,
        help="decode steps per worker stream event (1: per token, as a real site; the JSON records it)",
    )
    p.add_argument("--output-mean", type=int, default=SHORT_OUTPUTS.mean)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument(
        "--dashboard",
        metavar="URL",
        default=None,
        help="a running `fedctl dashboard` (http://127.0.0.1:8070) to mark the fault and its heal on",
    )
    key_quota.add_arguments(p)


def drill_config(args: argparse.Namespace) -> Config:
    """The bench's slowed federation (on free ports, every site's workers on known ones), routing
    by its config's policy, with as many gateway processes as the open requests need (one for
    the usual 18,000)."""
    gpus = defaults_for(args.scenario, args.quick).gpus if args.config is None else None
    base = bench_config(args.config, args.speed, None, args.stream_interval, gpus)
    return base.with_gateway(processes=math.ceil(args.open_requests / GATEWAY_STREAMS_PER_PROCESS))


def main(args: argparse.Namespace) -> int:
    if args.scenario == KEY_QUOTA:
        report = key_quota.run(args)
        return _emit(report, key_quota.summary(report), args.json)
    refused = _refusal(args)
    if refused:
        print(f"fedctl drill: {refused}", file=sys.stderr)
        return 2
    defaults = defaults_for(args.scenario, args.quick)
    if args.open_requests is None:
        args.open_requests = defaults.open_requests
    for name, default in zip(("warmup_s", "before_s", "after_s"), defaults.windows_s, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    site = args.site or DEFAULT_SITE.get(args.scenario, REMOTE_SITE)
    try:
        report = (_drill_endpoint if args.endpoint else _drill_embedded)(args, site)
    except DrillError as exc:
        print(f"fedctl drill: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, DrillRefused) else 1
    return _emit(report, summary(report), args.json)


def _emit(report: dict[str, Any], text: str, json_path: Path | None) -> int:
    """The report on stdout (and in `json_path`), its summary on stderr."""
    print(json.dumps(report, indent=2))
    print(text, file=sys.stderr)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def summary(report: dict[str, Any]) -> str:
    """The drill's outcome as a reader wants it first: what was lost, how fast the fault was
    seen, what the federation delivered after it, and how true the capacity estimates stayed."""

    def rate(key: str) -> str:
        value = report.get(key)
        return f"{value / 1000:,.1f} k tok/s" if value is not None else "-"

    rows = [
        ("requests", f"{report['requests_sent']:,} sent, {report['requests_failed']} failed, {report['lost']} lost"),
        ("failed over", f"{report['resumed']:,} resumed mid-stream, {report['retries']:,} retried before a token"),
        ("fault seen", f"{report['detection_s']} s" if report["detection_s"] is not None else "not seen"),
        ("delivered", f"{rate('output_tokens_per_s_before')} before, {rate('output_tokens_per_s_after')} after"),
        ("after / surviving", f"{report.get('after_over_surviving')}"),
    ]
    for site, error in sorted((report.get("capacity_error") or {}).items()):
        rows.append((f"capacity error {site}", f"mean {error['mean']}, max {error['max']}"))
    width = max(len(name) for name, _ in rows)
    title = f"fedctl drill {report['scenario']} ({report['site']})"
    return "\n".join([title, *(f"  {name:<{width}}  {value}" for name, value in rows)])


def _refusal(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot make a drill (None when they can)."""
    if args.quick and (args.scenario == "add-site" or args.endpoint):
        return "--quick runs its own small federation, with a site to hit: not with add-site or --endpoint"
    if args.scenario == "cpu-starve" and args.starve_ms >= args.starve_period_ms:
        return f"--starve-ms ({args.starve_ms:g}) must be shorter than --starve-period-ms ({args.starve_period_ms:g})"
    operator_only = [flag for flag in ("scheduler", "inject", "heal") if getattr(args, flag)]
    if mtls.given(args):
        operator_only.append("ca/--cert/--key/--insecure")
    if not args.endpoint:
        return f"--{operator_only[0]} needs --endpoint" if operator_only else None
    if args.config:
        return "--config describes the embedded default; --endpoint drills a running federation"
    if args.scenario == "drain":
        return "drain needs no --inject/--heal: it is `fedctl site drain`" if args.inject or args.heal else None
    if not args.inject:
        return f"{args.scenario} against --endpoint needs --inject CMD, the command that causes the fault"
    return None


def _drill_embedded(args: argparse.Namespace, site: str) -> dict[str, Any]:
    args.speed = args.speed or defaults_for(args.scenario, args.quick).speed
    config = drill_config(args)
    _check_site(args, site, {s.name for s in config.sites})
    if args.scenario == "worker-loss":
        _check_workers(site, next(s.gpus for s in config.sites if s.name == site))
    if args.scenario == "add-site":
        _check_joining_links(config)
    log_path = (args.json.parent if args.json else Path(".")) / "drill-logs" / f"{args.scenario}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.unlink(missing_ok=True)
    with log_path.open("a") as log:
        federation = Federation(
            config, log, scheduler_links=SCENARIOS[args.scenario].needs_scheduler_links, faults=True
        )
        try:
            federation.up()
            return {**_drill(Target.embedded(federation), args, site), "policy": config.scheduler.policy}
        finally:
            federation.down()


def _by_schedulers_clock(fault: Fault, fault_at: float, polled_s: float | None) -> float | None:
    """When the schedulers saw the fault: the poll sees it up to one state query late (each asks
    every replica over a fresh channel, slow under a drill's load), so the site's own clock
    (how long ago its status, or its healthy workers, changed) says when, bounded by the poll."""
    if polled_s is None:
        return None
    try:
        age = fault.detected_age_s()
    except (grpc.RpcError, OSError):
        return polled_s
    if age is None:
        return polled_s
    return max(0.0, min(polled_s, time.monotonic() - age - fault_at))


# What a drill's --heal-after-s does, on its timeline, when it is not a heal.
SECOND_MARKS = {"scheduler-crash": "all schedulers killed", "scheduler-blackhole": "all schedulers blackholed"}


def _drill_endpoint(args: argparse.Namespace, site: str) -> dict[str, Any]:
    """An operator's federation: its gateway, its schedulers (named, or as the gateway names
    them), broken by the operator's commands."""
    args.speed = args.speed or 1.0
    gateway_url = args.endpoint.rstrip("/").removesuffix("/v1")
    health = admin.gateway_health(gateway_url)
    schedulers = args.scheduler or health.get("schedulers") or []
    if not schedulers:
        raise DrillRefused(f"{gateway_url} names no scheduler ({health}); give --scheduler")
    try:
        operator = mtls.tls_from(args, pki.OPERATOR)
    except PkiError as exc:
        raise DrillRefused(f"--endpoint: the operator's certificate: {exc}") from None
    target = Target(gateway_url, list(schedulers), operator, inject_command=args.inject, heal_command=args.heal)
    states = target.site_states()
    if not states:
        raise DrillRefused(f"no scheduler replica answered: {', '.join(schedulers)}")
    _check_site(args, site, set(states))
    if args.scenario == "worker-loss":
        _check_workers(site, states[site].total_workers)
    return _drill(target, args, site)


def _check_site(args: argparse.Namespace, site: str, sites: set[str]) -> None:
    """The site hit must be in the federation; the one added must not."""
    if args.scenario == "add-site" and site in sites:
        raise DrillRefused(f"a site named {site!r} is already in the federation; name the new one with --site")
    if args.scenario != "add-site" and site not in sites:
        raise DrillRefused(f"no site named {site!r} (sites: {', '.join(sorted(sites))}); name one with --site")


def _check_joining_links(config: Config) -> None:
    """add-site's new site needs its round trips in the config: refused now, not minutes into the
    drill, when it would join."""
    try:
        config.rtt_between(JOINING_REGION, config.gateway.region)
        config.rtt_between(JOINING_REGION, config.scheduler_region)
    except ConfigError as exc:
        raise DrillRefused(f"add-site's new site is in {JOINING_REGION}: {exc}") from None


def _check_workers(site: str, workers: int) -> None:
    """worker-loss must leave the site a worker (losing them all is all-workers-lost)."""
    if WorkerLoss.lost_of(workers) < 1:
        raise DrillRefused(
            f"worker-loss needs a site of 2 workers or more ({site} has {workers}); all-workers-lost loses them all"
        )


def _drill(target: Target, args: argparse.Namespace, site: str) -> dict[str, Any]:
    # The workload once the drill is known to be possible: four samples per open request (the
    # tokenizer's load and tokenizing tens of thousands of prompts) are not spent on a refusal.
    output = dataclasses.replace(SHORT_OUTPUTS, mean=args.output_mean)
    workload = WorkloadSpec(4 * args.open_requests, args.seed, MLPERF_LIKE_PROMPTS, output).samples()
    fault: Fault = SCENARIOS[args.scenario](site, target)
    if isinstance(fault, SiteBrownout):
        fault.slowdown = args.slowdown
    if isinstance(fault, CpuStarve):
        fault.starve_ms, fault.period_ms = args.starve_ms, args.starve_period_ms
    try:
        return _under_load(target, args, site, output, workload, fault)
    finally:
        fault.end()  # however the drill ends: no agent is left stopped


def _under_load(
    target: Target,
    args: argparse.Namespace,
    site: str,
    output: LengthDistribution,
    workload: Sequence[Sample],
    fault: Fault,
) -> dict[str, Any]:
    heals = fault.heals and (target.federation is not None or bool(target.heal_command))
    marks = DashboardMarks(args.dashboard)
    total_s = args.warmup_s + args.before_s + args.after_s
    outcome: dict[str, Any] = {}

    def load() -> None:
        # The open requests start over the warm-up's first half: no opening burst, whose prefill
        # then decode waves would take minutes to even out into a fleet's steady mix.
        sustain = scenarios.Sustain(0.0, total_s * args.speed, ramp_s=args.warmup_s / 2 * args.speed)
        outcome["results"], outcome["window"] = scenarios.run_sustained(
            target.endpoint, workload, args.open_requests, sustain, args.speed, f"drill {args.scenario}"
        )

    sampler = SiteTokenSampler(target.metrics_url, target.site_states)
    sampler.start()
    thread = threading.Thread(target=load, name="drill load", daemon=True)
    started = time.monotonic()
    thread.start()
    fault_at = started + scenarios.start_delay_s(args.open_requests) + args.warmup_s + args.before_s
    time.sleep(max(0.0, fault_at - time.monotonic()))
    counters_before = gateway_counters(target.metrics_url)
    fault.before = target.site_states().get(site)
    print(f"fedctl drill: {args.scenario} at {site}", file=sys.stderr, flush=True)
    fault_at = time.monotonic()
    fault.inject()  # a DrillError leaves the load and the sampler to die with the process (daemons)
    marks.mark(f"{args.scenario} ({site})")
    # Seen after the load ends is not seen by the drill (and cpu-starve, seen only if routing
    # overreacts, would otherwise starve its agent on past the load).
    polled_s = poll_until(
        fault.detected, max(0.0, min(DETECTION_TIMEOUT_S, fault_at + args.after_s - time.monotonic()))
    )
    detection_s = _by_schedulers_clock(fault, fault_at, polled_s)
    heal_at = None
    if heals:
        time.sleep(max(0.0, fault_at + args.heal_after_s - time.monotonic()))
        heal_at = time.monotonic()
        fault.heal()
        marks.mark(SECOND_MARKS.get(args.scenario, "heal"))
    thread.join()
    fault.end()  # a fault that lasts to the end of the load (cpu-starve) ends with it
    agent_status = _agent_status(target, site) if isinstance(fault, CpuStarve) else None
    marks.wait()
    samples = sampler.stop()
    counters_after = gateway_counters(target.metrics_url) if target.gateway_alive() else counters_before
    results: list[Result] = outcome["results"]
    end = outcome["window"][1]
    line = timeline.build(results, samples, fault_at, args.speed, end)
    line.marks[args.scenario] = 0.0
    if heal_at is not None:
        line.marks[SECOND_MARKS.get(args.scenario, "heal")] = heal_at - fault_at
    healed_s = heal_at - fault_at if heal_at is not None else None
    if target.federation is not None:
        # Each site's truth on the mix it ran before the fault and the one it ran after (truth.py).
        before = site_workloads(r for r in results if fault_at - args.before_s <= r.finished <= fault_at)
        after = site_workloads(r for r in results if r.finished >= fault_at + ESTIMATE_SETTLE_S)
        work = workload_of(MLPERF_LIKE_PROMPTS, output)
        line.set_truth(_truth(target.federation.config, fault, work, before, after, healed_s))
    report = _report(args, site, results, line, fault, detection_s, healed_s, counters_before, counters_after)
    report.update(_against_truth(report, line, args, healed_s, known=target.federation is not None))
    report["detection_polled_s"] = round(polled_s, 3) if polled_s is not None else None  # when the poll saw it
    # Requests that started at the site after the fault was seen (a drained site must get none).
    seen_at = fault_at + (detection_s or 0.0) + ROUTE_IN_TRANSIT_S
    report["routed_to_site_after_fault"] = sum(1 for r in results if r.site == site and r.started > seen_at)
    if args.scenario == "add-site":
        report.update(_joined(report, line, args))
    if isinstance(fault, CpuStarve):
        report.update(_starved(report, args, fault, agent_status))
    if args.png:
        timeline.plot(line, f"fedctl drill {args.scenario} ({site})", args.png)
        report["png"] = str(args.png)
    return report


def _truth(
    config: Config,
    fault: Fault,
    work: Workload,
    before: Mapping[str, Workload],
    after: Mapping[str, Workload],
    healed_s: float | None,
) -> TruthLine:
    """Each site's truth through the drill (wall s from the fault): its GPUs on the mix it ran
    before the fault, and from the fault on the mix it ran after it (the drill's `work` for a
    site that completed too little to say); from the fault, the hit site's times the fault's
    capacity factor, until a heal that restores it (a partition's); an added site's from the
    fault on."""
    truth = TruthLine()
    for s in config.sites:
        whole = site_truth_tok_s(s.gpu, s.gpus, before.get(s.name, work))
        later = site_truth_tok_s(s.gpu, s.gpus, after.get(s.name, before.get(s.name, work)))
        if isinstance(fault, SiteJoin) and s.name == fault.site:
            truth.set(s.name, 0.0, later)
            continue
        truth.set(s.name, -math.inf, whole)
        if s.name == fault.site and fault.capacity_factor is not None:
            truth.set(s.name, 0.0, later * fault.capacity_factor)
            if healed_s is not None:
                truth.set(s.name, healed_s, later)
        else:
            truth.set(s.name, 0.0, later)
    return truth


def _against_truth(
    report: dict[str, Any], line: timeline.Timeline, args: argparse.Namespace, healed_s: float | None, *, known: bool
) -> dict[str, Any]:
    """The estimator measured against the truth (see the module docstring), and what the
    federation kept of the throughput that survived the fault."""
    after, surviving = report["output_tokens_per_s_after"], report["surviving_tokens_per_s"]
    out: dict[str, Any] = {"after_over_surviving": round(after / surviving, 4) if surviving else None}
    if not known:
        return {**out, "capacity_error": None, "capacity_error_note": NO_TRUTH}
    after_start_s, after_end_s = _after(args, healed_s)
    windows = [(-args.before_s, 0.0), (ESTIMATE_SETTLE_S, args.after_s - 1.0)]
    return {
        **out,
        "capacity_error": line.capacity_errors(windows),
        "capacity_truth_before": {k: round(v, 1) for k, v in line.truth_means(-args.before_s, 0.0).items()},
        "capacity_truth_after": {k: round(v, 1) for k, v in line.truth_means(after_start_s, after_end_s).items()},
    }


def _agent_status(target: Target, site: str) -> str | None:
    """The starved agent's process state as psutil reads it once the starving is over ("stopped"
    would be a process left stopped); None when it is gone or not ours to see."""
    if target.federation is None:
        return None
    try:
        return psutil.Process(target.federation.child(f"agent {site}").pid).status()
    except psutil.NoSuchProcess:
        return None


def _starved(report: dict[str, Any], args: argparse.Namespace, fault: CpuStarve, status: str | None) -> dict[str, Any]:
    """cpu-starve's own keys: the starved site's share of the tokens before and after (it
    should barely move), its estimate's error, and that its agent was stopped and left running."""
    site = report["site"]

    def share(rates: dict[str, float]) -> float | None:
        total = sum(rates.values())
        return round(rates.get(site, 0.0) / total, 4) if total else None

    errors = report.get("capacity_error")
    return {
        "site_share_before": share(report["per_site_tokens_per_s_before"]),
        "site_share_after": share(report["per_site_tokens_per_s_after"]),
        "site_capacity_error": errors.get(site) if errors is not None else None,
        "starve_ms": args.starve_ms,
        "starve_period_ms": args.starve_period_ms,
        "agent_stops": fault.starver.stops if fault.starver is not None else None,
        "agent_status_after": status,
    }


def _joined(report: dict[str, Any], line: timeline.Timeline, args: argparse.Namespace) -> dict[str, Any]:
    """add-site's own keys. `converge_s` is GPU seconds, as `fedctl bench` reports times: how long
    the new site takes to fill is set by how fast requests finish elsewhere and how long its
    first batches take to prefill, which the emulated GPUs stretch by 1/speed in wall time (the
    wall seconds are beside it). Each site's standalone capacity is what the schedulers measure
    it to deliver on this workload (a site loaded past its slots delivers exactly that), and the
    ratio compares the throughput once the new site's share has settled with their sum, over
    the same seconds: below 1 only where routing leaves a site short of work."""
    settled_wall_s = report["share_converge_s"]
    after_start_s, end_s = _after(args, None)
    start_s = settled_wall_s if settled_wall_s is not None else after_start_s
    standalone = {k: round(v, 1) for k, v in line.capacity_means(start_s, end_s).items()}
    total = sum(standalone.values())
    settled = line.rate(start_s, end_s)
    return {
        "standalone": standalone,
        "output_tokens_per_s_settled": round(settled, 1),
        "throughput_ratio": round(settled / total, 4) if total else None,
        "converge_s": round(settled_wall_s * args.speed, 2) if settled_wall_s is not None else None,
        "converge_wall_s": settled_wall_s,
    }


def _during_s(args: argparse.Namespace, healed_s: float | None) -> float:
    """ "During": the fault's first seconds, or until its second act (a partition healed, the
    last scheduler killed)."""
    return min(DURING_S, args.after_s / 2) if healed_s is None else healed_s


def _after(args: argparse.Namespace, healed_s: float | None) -> tuple[float, float]:
    """ "After": from the end of "during" (a few seconds on, after a heal) to the end of the load,
    whose last second is not "after" (the load stops)."""
    start_s = _during_s(args, None) if healed_s is None else healed_s + SETTLE_S
    return start_s, args.after_s - 1.0


def _report(
    args: argparse.Namespace,
    site: str,
    results: list[Result],
    line: timeline.Timeline,
    fault: Fault,
    detection_s: float | None,
    healed_s: float | None,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    failed = [r for r in results if not r.ok]
    lost = [r for r in failed if not (r.error or "").startswith("HTTP ")]  # accepted (200), never completed
    during_s, (after_start_s, after_end_s) = _during_s(args, healed_s), _after(args, healed_s)
    rate_before = line.rate(-args.before_s, 0.0)
    per_site_before = line.site_rates(-args.before_s, 0.0)
    surviving = fault.surviving(per_site_before)
    recovery_s = line.first_time_at_least(RECOVERY_LEVEL * sum(surviving.values()))
    # The share a site should settle at: its part of the capacity the schedulers measure after
    # the fault (0 for a site that takes no new work).
    capacity_before = line.capacity_means(-args.before_s, 0.0)
    capacity_after = line.capacity_means(after_start_s, after_end_s)
    # None when no scheduler answered after the fault (all replicas killed or cut off, or every
    # site down at the ones that did): nothing to follow.
    total_after = sum(capacity_after.values())
    target_share = capacity_after.get(site, 0.0) / total_after if total_after else None
    true_capacity = (
        capacity_before[site] * fault.capacity_factor
        if fault.capacity_factor is not None and site in capacity_before
        else None
    )
    capacity_converge_s = line.capacity_settles(site, true_capacity, WITHIN) if true_capacity else None

    def delta(name: str) -> int:
        return round(after.get(name, 0.0) - before.get(name, 0.0))

    errors: dict[str, int] = {}
    for r in failed:
        errors[(r.error or "")[:120]] = errors.get((r.error or "")[:120], 0) + 1
    return {
        "scenario": args.scenario,
        "site": site,
        "requests_sent": len(results),
        "requests_ok": len(results) - len(failed),
        "requests_failed": len(failed),
        "lost": len(lost),
        "retries": delta("federation_gateway_retries_total"),
        "resumed": delta("federation_gateway_resumed_total"),
        "detection_s": round(detection_s, 3) if detection_s is not None else None,
        "recovery_s": round(recovery_s, 1) if recovery_s is not None else None,
        "output_tokens_per_s_before": round(rate_before, 1),
        "output_tokens_per_s_during": round(line.rate(0.0, during_s), 1),
        "output_tokens_per_s_after": round(line.rate(after_start_s, after_end_s), 1),
        "surviving_tokens_per_s": round(sum(surviving.values()), 1),
        "capacity_before": {k: round(v, 1) for k, v in capacity_before.items()},
        "capacity_after": {k: round(v, 1) for k, v in capacity_after.items()},
        "capacity_true_after": round(true_capacity, 1) if true_capacity else None,
        "capacity_converge_s": capacity_converge_s,
        "share_target": round(target_share, 4) if target_share is not None else None,
        "share_converge_s": line.share_settles(site, target_share, WITHIN) if target_share is not None else None,
        "per_site_tokens_per_s_before": {k: round(v, 1) for k, v in per_site_before.items()},
        "per_site_tokens_per_s_after": {k: round(v, 1) for k, v in line.site_rates(after_start_s, after_end_s).items()},
        "outstanding_requests_before": {k: round(v) for k, v in line.outstanding_means(-args.before_s, 0.0).items()},
        "outstanding_requests_after": {
            k: round(v) for k, v in line.outstanding_means(after_start_s, after_end_s).items()
        },
        "speed": args.speed,
        # decode steps per worker stream event: 1 is a real site's pace (None: the endpoint's own)
        "stream_interval": None if args.endpoint else args.stream_interval,
        "open_requests": args.open_requests,
        "errors": errors,
    }
