"""`fedctl bench`: the federation's throughput and latency, beside each site alone and the peers.

One invocation measures, on the same seeded workload: the federation under `--policy`;
with `--compare-standalone`, each site alone (its share of the samples, in proportion to
its declared capacity, so every run lasts about as long); with `--compare`, our own
baseline policies; with `--peers`, the real sglang-router over the same emulated workers,
flat. Federation efficiency = federated tokens/s ÷ the sum of the standalone tokens/s.

Against `--endpoint URL` it measures that endpoint only (tell it `--speed` if the GPUs
behind it are emulated slower than real time).

Every run on the embedded federation (and `--loadgen`'s) also reports `capacity_error`: how far
the schedulers' capacity estimates were from each site's truth over the run's measured window
(`estimates.py`, `truth.py`). `--datapath` does not: it measures CPU per token, which polling
the schedulers would add to.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any

import grpc

from core import runtime, wire
from core.config import Config, load
from core.policy import POLICIES
from core.processes import free_port_block
from federation import admin
from federation.bench import conversations, datapath, scenarios, tiers
from federation.bench.client import Result
from federation.bench.estimates import NO_TRUTH, EstimateSampler
from federation.bench.peers import ROUTER_POLICIES, FlatRouter
from federation.bench.truth import site_workloads, workload_of
from federation.bench.workload import (
    GSP_GROUPS,
    GSP_OUTPUT_TOKENS,
    GSP_PROMPTS_PER_GROUP,
    MLPERF_LIKE_OUTPUTS,
    MLPERF_LIKE_PROMPTS,
    SHORT_OUTPUTS,
    Sample,
    WorkloadSpec,
    shared_prefix_samples,
)
from federation.embedded import Federation
from scheduler.capacity import prior_capacity_tok_s
from scheduler.workload import Workload

# 32 emulated GPUs at SGLang's per-token pace, their clients and every hop of the federation
# share this machine's cores, and every token costs CPU in each of those processes; a twentieth
# of real speed (~13 k tokens/s from the embedded default) leaves the cores room, the CPU out of
# the measurement (what a token costs and what the cores carry: docs/BENCHMARKS.md, "SGLang's
# per-token pace").
BENCH_SPEED = 0.05
DEFAULT_REQUESTS = 20_000
BENCH_GATEWAY_PROCESSES = 2  # 24 k open requests need two processes' file descriptors
SEARCH_STEPS = 4  # bisection steps of the Server rate search: the answer within ~1 % of Offline
# The search looks between this fraction of the Offline rate and all of it: the bar is 0.95,
# and a rate that fails even here is reported as not meeting the limits.
SEARCH_LOW_FRACTION = 0.85
# A sustained run's warm-up (GPU s): more than an average answer's life at full batch
# (~1,278 tokens × ~70 ms), so the opening burst is over and answers end at spread times.
DEFAULT_WARMUP_S = 150.0


def _names(allowed) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated list of names from `allowed`."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n for n in text.split(",") if n)
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)} (choose from {', '.join(allowed)})")
        return names

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=["offline", "server"], default="offline")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="mlperf-like",
        help="mlperf-like: MLPerf's lengths, no prompt shares a prefix (--requests, --prompt-*, --output-*); "
        "shared-prefix: SGLang's generated-shared-prefix set at its defaults (64 groups x 16 questions after "
        "a 2,048-token system prompt each, 128-token questions, 256-token answers); multi-turn: conversations "
        "whose history grows, at SGLang's multi-turn benchmark's defaults (256 conversations of 5 turns, "
        "512-token opening and questions, 64-token answers; federation/bench/conversations.py); tiers: "
        "priority, default and flex (20/50/30 %%) at 1.5x the federation's Offline rate with a site crash, "
        "on mlperf-like's lengths (federation/bench/tiers.py)",
    )
    for workload, flags in WORKLOAD_FLAGS.items():
        for dest, (default, what) in flags.items():
            flag = "--" + dest.replace("_", "-")
            p.add_argument(
                flag, type=runtime.positive_int, default=None, help=f"{workload}: {what} (default {default})"
            )
    p.add_argument("--requests", type=runtime.positive_int, default=DEFAULT_REQUESTS, help="samples per run")
    p.add_argument(
        "--rate",
        type=runtime.positive_float,
        default=None,
        help="Server: arrivals/s (GPU time); omit to search (multi-turn: turns/s, required)",
    )
    p.add_argument(
        "--sustain-s",
        type=runtime.positive_float,
        default=None,
        help="Offline held loaded (every finished sample replaced at once), measured over this many GPU s after --warmup-s",
    )
    p.add_argument(
        "--warmup-s",
        type=runtime.positive_float,
        default=None,
        help=f"of a sustained run (default {DEFAULT_WARMUP_S:.0f}) or of each --datapath phase ({datapath.WARMUP_S:.0f})",
    )
    p.add_argument("--policy", choices=sorted(POLICIES), default="least_expected_delay")
    p.add_argument("--compare", type=_names(POLICIES), default=(), help="more of our policies to run, comma-separated")
    p.add_argument(
        "--peers",
        type=_names(ROUTER_POLICIES),
        default=(),
        help=f"sglang-router policies to run flat over the same workers: {', '.join(ROUTER_POLICIES)}",
    )
    p.add_argument("--compare-standalone", action="store_true", help="each site alone, then federation efficiency")
    p.add_argument(
        "--loadgen", choices=["offline", "server"], default=None, help="drive the endpoint with MLPerf LoadGen"
    )
    p.add_argument(
        "--min-duration-s", type=runtime.positive_float, default=60.0, help="LoadGen min duration (GPU time)"
    )
    p.add_argument("--endpoint", default=None, help="measure this endpoint (…/v1) instead of starting the federation")
    p.add_argument("--config", type=Path, default=None, help="the federation to start (default: the embedded one)")
    p.add_argument(
        "--speed", type=runtime.positive_float, default=None, help=f"emulated GPU speed (default {BENCH_SPEED})"
    )
    p.add_argument(
        "--stream-interval",
        type=runtime.positive_int,
        default=1,
        help="decode steps per worker stream event, as SGLang's --stream-interval (1: per token, a real site's "
        "pace; more is coarser than real, and the JSON says so)",
    )
    p.add_argument(
        "--max-in-flight",
        type=runtime.positive_int,
        default=None,
        help=f"open requests at most (default {scenarios.MAX_IN_FLIGHT:,}; --datapath: the sites' running slots)",
    )
    p.add_argument(
        "--datapath",
        action="store_true",
        help="CPU per token per hop at SGLang's per-token pace, and the sglang-router's in the same run "
        "(see federation/bench/datapath.py)",
    )
    p.add_argument(
        "--scale-gateways",
        type=runtime.positive_int,
        default=None,
        metavar="N",
        help="with --datapath: the federation phase again with N gateway processes sharing its port "
        "(SO_REUSEPORT), and the gateway tier's CPU per token and per 100 k tok/s at 1 and N",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext gRPC between the federation's processes (default: mutual TLS), to measure what TLS costs",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output-mean",
        type=int,
        default=None,
        help=f"answer tokens, mean (default {MLPERF_LIKE_OUTPUTS.mean:,}; tiers: {SHORT_OUTPUTS.mean}, the drills')",
    )
    p.add_argument(
        "--output-sigma",
        type=float,
        default=None,
        help=f"log-normal spread; 0: fixed (default {MLPERF_LIKE_OUTPUTS.sigma}; tiers: {SHORT_OUTPUTS.sigma})",
    )
    p.add_argument("--prompt-mean", type=int, default=MLPERF_LIKE_PROMPTS.mean)
    p.add_argument("--prompt-sigma", type=float, default=MLPERF_LIKE_PROMPTS.sigma)
    p.add_argument("--json", type=Path, default=None, help="write the results here")


def bench_config(
    path: Path | None,
    speed: float | None,
    policy: str | None,
    stream_interval: int,
    gpus: dict[str, int] | None = None,
) -> Config:
    """The federation to start, slowed down as a whole: GPUs and the data path's WAN round trips
    alike, so that a wall-clock second is `speed` GPU seconds on every token's way; the control
    plane's links keep their real round trips, as its clocks (heartbeats, timeouts) are not
    slowed; on ports free now (`_on_free_ports`). `policy`: None keeps the config's; `gpus`:
    sites given that many GPUs instead."""
    config = load(path).with_overrides(speed=speed or BENCH_SPEED, policy=policy, stream_interval=stream_interval)
    if gpus:
        config = config.with_gpus(gpus)
    return _on_free_ports(
        dataclasses.replace(
            config, rtt_ms={k: v / config.speed for k, v in config.rtt_ms.items()}, control_rtt_ms=config.rtt_ms
        ).with_gateway(
            processes=max(config.gateway.processes, BENCH_GATEWAY_PROCESSES),
            max_connections_per_address=0,  # the load generator is one address
        )
    )


def _on_free_ports(config: Config) -> Config:
    """Every port a free one below the ephemeral range, every site's workers on known ports (a
    drill's faults reach them there). A run's ~20 k client connections take ephemeral ports,
    and the configured ones (50051, ...) sit in that range: a run right after another, or
    after a test run, could not bind them."""
    first = free_port_block(1 + config.scheduler.replicas + sum(1 + s.gpus for s in config.sites))
    gateway_port, scheduler_port = first, first + 1  # replica i listens on scheduler_port + i
    port, sites = scheduler_port + config.scheduler.replicas, []
    for s in config.sites:  # the agent's port, then its workers'
        sites.append(dataclasses.replace(s, agent_port=port, worker_port=port + 1))
        port += 1 + s.gpus
    placed = dataclasses.replace(config, sites=tuple(sites))
    return placed.with_gateway(port=gateway_port).with_scheduler(port=scheduler_port)


WORKLOADS = ("mlperf-like", "shared-prefix", "multi-turn", "tiers")
# Each workload's own flags (argparse's dest), their defaults and what they say. Given for
# another workload they would change nothing, so they are refused (`workload_flags`).
WORKLOAD_FLAGS: dict[str, dict[str, tuple[int, str]]] = {
    "shared-prefix": {  # SGLang's bench_serving flags
        "gsp_num_groups": (GSP_GROUPS, "system prompts"),
        "gsp_prompts_per_group": (GSP_PROMPTS_PER_GROUP, "questions after each"),
        "gsp_output_len": (GSP_OUTPUT_TOKENS, "answer tokens"),
    },
    "multi-turn": {
        "conversations": (conversations.CONVERSATIONS, "conversations"),
        "turns": (conversations.TURNS, "turns of each"),
    },
}


def workload_flags(args: argparse.Namespace) -> str | None:
    """Fills in the defaults of the run's workload flags; says which flag was given for another
    workload (None when none was)."""
    for workload, flags in WORKLOAD_FLAGS.items():
        for dest, (default, _) in flags.items():
            if getattr(args, dest) is None:
                setattr(args, dest, default)
            elif args.workload != workload:
                return f"--{dest.replace('_', '-')} is for --workload {workload}, not {args.workload}"
    return None


# A prefix cache hit skips prefill, so what a site truly delivers then depends on how many hit.
NO_REUSE_TRUTH = "unknown: with prompts that share prefixes a site's truth depends on its cache hits"


def _samples(args: argparse.Namespace) -> list[Sample]:
    """The workload's samples (multi-turn makes its prompts as its conversations go: none)."""
    if args.workload == "shared-prefix":
        return shared_prefix_samples(
            args.seed, args.gsp_num_groups, args.gsp_prompts_per_group, output_tokens=args.gsp_output_len
        )
    if args.workload == "multi-turn":
        return []
    return _workload(args).samples()


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        args.requests,
        args.seed,
        dataclasses.replace(MLPERF_LIKE_PROMPTS, mean=args.prompt_mean, sigma=args.prompt_sigma),
        dataclasses.replace(MLPERF_LIKE_OUTPUTS, mean=args.output_mean, sigma=args.output_sigma),
    )


def _truth_workload(args: argparse.Namespace) -> Workload:
    """The bench's workload as the GPU model reads it: what each site's truth is measured on."""
    spec = _workload(args)
    return workload_of(spec.prompt, spec.output)


def _measure(
    endpoint: str,
    samples: Sequence[Sample],
    args: argparse.Namespace,
    speed: float,
    label: str,
    estimates: EstimateSampler | None = None,
) -> dict:
    """One run of the chosen scenario against `endpoint` (for Server without --rate: the search);
    with `estimates`, each run's `capacity_error` over its measured window."""
    if args.workload == "multi-turn":
        return _conversations(endpoint, args, speed, label)
    if args.scenario == "offline":
        return _offline(endpoint, samples, args, speed, label, estimates)
    if args.rate is None:
        return _search(endpoint, samples, args, speed, label, estimates)
    return _server(endpoint, samples, args, speed, label, args.rate, estimates)


def _offline(
    endpoint: str,
    samples: Sequence[Sample],
    args: argparse.Namespace,
    speed: float,
    label: str,
    estimates: EstimateSampler | None = None,
) -> dict:
    """Every sample at once, or with --sustain-s the endpoint held loaded and measured in a window."""
    if args.sustain_s is None:
        results = scenarios.run_plan(endpoint, scenarios.offline_plan(samples), args.max_in_flight, label)
        summary = scenarios.summarize(results, scenario="offline", policy=label, speed=speed)
        return _with_error(summary, estimates, scenarios.steady_window(results), results)
    sustain = scenarios.Sustain(args.warmup_s, args.sustain_s, cut_at_end=True)
    results, window = scenarios.run_sustained(endpoint, samples, args.max_in_flight, sustain, speed, label)
    summary = scenarios.summarize(results, scenario="offline", policy=label, speed=speed, window=window)
    summary = {**summary, "sustained": {"warmup_s": sustain.warmup_s, "window_s": sustain.window_s}}
    return _with_error(summary, estimates, window, results)


def _conversations(endpoint: str, args: argparse.Namespace, speed: float, label: str) -> dict[str, Any]:
    """Every conversation to its end (conversations.py): the run's keys, over all their turns."""
    spec = conversations.Conversations(args.conversations, args.turns, seed=args.seed, rate=args.rate)
    runs = conversations.run(endpoint, spec, speed, label)
    results = [r for turns in runs for r in turns]
    summary = scenarios.summarize(results, scenario=args.scenario, policy=label, speed=speed)
    return {**summary, "affinity": conversations.affinity(runs), "conversations": len(runs)}


def _server(
    endpoint: str,
    samples,
    args: argparse.Namespace,
    speed: float,
    label: str,
    rate: float,
    estimates: EstimateSampler | None = None,
) -> dict:
    plan = scenarios.server_plan(samples, rate, speed=speed, seed=args.seed, max_in_flight=args.max_in_flight)
    results = scenarios.run_plan(endpoint, plan, args.max_in_flight, f"{label} server {rate:.1f}/s")
    summary = {
        **scenarios.summarize(results, scenario="server", policy=label, speed=speed),
        "rate": round(rate, 3),
        "served_output_tokens_per_s": round(scenarios.served_rate(results, speed), 1),
    }
    summary = {**summary, "meets_limits": scenarios.meets_server_limits(summary)}
    arrivals = [r.started for r in results]  # what served_rate is measured over
    return _with_error(summary, estimates, (min(arrivals), max(arrivals)) if arrivals else None, results)


def _with_error(
    summary: dict[str, Any],
    estimates: EstimateSampler | None,
    window: tuple[float, float] | None,
    results: list[Result],
) -> dict[str, Any]:
    """The run's summary with its `capacity_error` (see estimates.py), when the schedulers were
    watched: each site against its truth on the mix it completed in the window."""
    if estimates is None:
        return summary
    inside = [r for r in results if window is None or window[0] <= r.finished <= window[1]]
    return {**summary, "capacity_error": estimates.capacity_error(window, site_workloads(inside))}


def _search(
    endpoint: str,
    samples,
    args: argparse.Namespace,
    speed: float,
    label: str,
    estimates: EstimateSampler | None = None,
) -> dict[str, Any]:
    """The highest Poisson rate meeting MLPerf's Server limits, by bisection below the Offline
    rate measured first in the same run (sustained if --sustain-s is given). Server ÷ Offline
    compares the Server run's served rate (`scenarios.served_rate`) with Offline's."""
    offline = _offline(endpoint, samples, args, speed, f"{label} offline", estimates)
    mean_output = sum(s.output_tokens for s in samples) / len(samples)
    hi = offline["output_tokens_per_s"] / mean_output  # no Server run can beat Offline
    lo, best, trials = SEARCH_LOW_FRACTION * hi, None, []
    for _ in range(SEARCH_STEPS):
        rate = (lo + hi) / 2
        summary = _server(endpoint, samples, args, speed, label, rate, estimates)
        ok = summary["meets_limits"]
        keys = ("rate", "served_output_tokens_per_s", "output_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms")
        trials.append({k: summary[k] for k in keys} | {"ok": ok})
        if ok:
            lo, best = rate, summary
        else:
            hi = rate
    result = best or summary
    return {
        **result,
        "search": trials,
        "meets_limits": best is not None,
        "offline": offline,
        "offline_output_tokens_per_s": offline["output_tokens_per_s"],
        "server_over_offline": round(result["served_output_tokens_per_s"] / offline["output_tokens_per_s"], 4),
    }


Started = tuple[str, int, EstimateSampler | None]  # the endpoint, its open requests at most, its estimates


def _federation(config: Config, insecure: bool, work: Workload) -> Callable[[IO[str] | None], AbstractContextManager]:
    """Starts the federation, its schedulers' estimates sampled while it runs, against each
    site's truth on `work` (the bench's workload)."""

    @contextlib.contextmanager
    def start(log: IO[str] | None) -> Iterator[Started]:
        federation = Federation(config, log, insecure=insecure)
        gpus = {s.name: (s.gpu, s.gpus) for s in config.sites}
        estimates = EstimateSampler(_states_of(config.scheduler_addresses, federation), gpus, work, config.speed)
        try:
            federation.up()
            estimates.start()
            yield config.gateway_url + "/v1", scenarios.MAX_IN_FLIGHT, estimates
        finally:
            estimates.stop()
            federation.down()

    return start


def _states_of(addresses: Sequence[str], federation: Federation) -> Callable[[], dict[str, wire.SiteState]]:
    """The sites as the first scheduler replica that answers sees them."""

    def states() -> dict[str, wire.SiteState]:
        for address in addresses:
            try:
                return {s.name: s for s in admin.fetch_state(address, federation.operator).sites}
            except grpc.RpcError:
                continue
        return {}

    return states


def _router(config: Config, policy: str) -> Callable[[IO[str] | None], AbstractContextManager]:
    @contextlib.contextmanager
    def start(log: IO[str] | None) -> Iterator[Started]:
        with FlatRouter(config, policy, log=log) as router:
            yield router.endpoint, router.max_open_streams, None

    return start


def _run_on(start, samples: Sequence[Sample], args: argparse.Namespace, speed: float, label: str) -> dict:
    """Start an endpoint (its processes' logs in a file beside the JSON), measure it, stop it."""
    log_dir = (args.json.parent if args.json else Path(".")) / "bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (label.replace(" ", "-") + ".log")
    log_path.unlink(missing_ok=True)
    # Append mode: every process writes whole lines at the end, none over another's.
    with log_path.open("a") as log, start(log) as (endpoint, max_in_flight, estimates):
        print(f"bench: {label} on {endpoint} (logs: {log_path})", file=sys.stderr, flush=True)
        run_args = argparse.Namespace(**{**vars(args), "max_in_flight": min(args.max_in_flight, max_in_flight)})
        summary = _measure(endpoint, samples, run_args, speed, label, estimates)
    if args.workload != "mlperf-like" and estimates is not None:
        summary = {**summary, "capacity_error": None, "capacity_error_note": NO_REUSE_TRUTH}
    return {**summary, "max_in_flight": run_args.max_in_flight}


def main(args: argparse.Namespace) -> int:
    if (refused := workload_flags(args)) is not None:
        print(f"fedctl bench: {refused}", file=sys.stderr)
        return 2
    outputs = SHORT_OUTPUTS if args.workload == "tiers" else MLPERF_LIKE_OUTPUTS
    args.output_mean = outputs.mean if args.output_mean is None else args.output_mean
    args.output_sigma = outputs.sigma if args.output_sigma is None else args.output_sigma
    if args.rate is not None and args.scenario != "server" and not args.loadgen:
        print("fedctl bench: --rate is for --scenario server or --loadgen (Offline sends at once)", file=sys.stderr)
        return 2
    if args.workload == "multi-turn" and args.scenario == "server" and args.rate is None:
        print("fedctl bench: --workload multi-turn --scenario server needs --rate (turns/s, GPU time)", file=sys.stderr)
        return 2
    if args.scale_gateways is not None and (not args.datapath or args.scale_gateways < 2):
        print("fedctl bench: --scale-gateways N needs --datapath and N of 2 or more", file=sys.stderr)
        return 2
    samples = _samples(args)
    if args.workload == "tiers":
        return _tiers(args, samples)
    if args.datapath:
        return _datapath(args, samples)
    args.warmup_s = args.warmup_s or DEFAULT_WARMUP_S
    args.max_in_flight = args.max_in_flight or scenarios.MAX_IN_FLIGHT
    if args.loadgen:
        return _loadgen(args, samples)
    if args.endpoint:
        speed = args.speed or 1.0
        report = _measure(args.endpoint.rstrip("/"), samples, args, speed, args.policy)
        return _write({**report, "capacity_error": None, "capacity_error_note": NO_TRUTH}, args.json)
    config = bench_config(args.config, args.speed, args.policy, args.stream_interval)
    work = _truth_workload(args)
    report = _run_on(_federation(config, args.insecure, work), samples, args, config.speed, config.scheduler.policy)
    report["stream_interval"] = config.stream_interval  # decode steps per worker event: 1 is a real site's pace
    report["workload"] = args.workload
    comparisons = {}
    for policy in args.compare:
        other = config.with_scheduler(policy=policy)
        comparisons[policy] = _run_on(_federation(other, args.insecure, work), samples, args, config.speed, policy)
    for policy in args.peers:
        name = f"sglang-router {policy}"
        start = _router(config, policy)
        comparisons[name] = _run_on(start, samples, args, config.speed, name)
    if comparisons:
        report["comparisons"] = comparisons
    if args.compare_standalone:
        alone = _standalone(config, samples, args)
        report["standalone"] = {name: run["steady_output_tokens_per_s"] for name, run in alone.items()}
        report["standalone_runs"] = alone
        report.update(_efficiency(report, alone))
        for other in comparisons.values():
            other.update(_efficiency(other, alone))
    return _write(report, args.json)


def _standalone(config: Config, samples: Sequence[Sample], args: argparse.Namespace) -> dict[str, dict]:
    """Each site alone with its declared share of the samples and of the open requests, so
    each is loaded as it is in the federation and each run lasts about as long."""
    priors = {s.name: prior_capacity_tok_s(s.gpu, s.gpus) for s in config.sites}
    out = {}
    for site in config.sites:
        share = priors[site.name] / sum(priors.values())
        alone = dataclasses.replace(config, sites=(site,))
        site_args = argparse.Namespace(**{**vars(args), "max_in_flight": max(1, round(args.max_in_flight * share))})
        subset = samples[: max(1, round(len(samples) * share))]
        start = _federation(alone, args.insecure, _truth_workload(args))
        out[site.name] = _run_on(start, subset, site_args, config.speed, f"{site.name} alone")
    return out


def _efficiency(report: dict, standalone: dict[str, dict]) -> dict[str, float]:
    """Federated tokens/s over the sum of each site's alone: over the fully loaded window, and
    by MLPerf's definition (to the last completion; see scenarios.steady_rate for why both)."""
    steady = sum(s["steady_output_tokens_per_s"] for s in standalone.values())
    to_last = sum(s["output_tokens_per_s"] for s in standalone.values())
    return {
        "federation_efficiency": round(report["steady_output_tokens_per_s"] / steady, 4) if steady else 0.0,
        "federation_efficiency_to_last_completion": round(report["output_tokens_per_s"] / to_last, 4),
    }


def _datapath(args: argparse.Namespace, samples: list[Sample]) -> int:
    if args.endpoint:
        print("fedctl bench: --datapath starts its own federation; it does not take --endpoint", file=sys.stderr)
        return 2
    args.warmup_s = args.warmup_s or datapath.WARMUP_S
    args.sustain_s = args.sustain_s or datapath.WINDOW_S
    config = datapath.datapath_config(args.config, args.speed or 1.0, args.stream_interval, _on_free_ports)
    log_dir = (args.json.parent if args.json else Path(".")) / "bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "datapath.log").open("w") as log:
        return _write(datapath.run(args, samples, config, log), args.json)


def _tiers(args: argparse.Namespace, samples: list[Sample]) -> int:
    """Service tiers under overload, on the embedded federation (or --config's) only."""
    others = {
        "--endpoint": args.endpoint,
        "--datapath": args.datapath,
        "--loadgen": args.loadgen,
        "--compare": args.compare,
        "--peers": args.peers,
        "--compare-standalone": args.compare_standalone,
        "--rate": args.rate,
        "--scenario server": args.scenario == "server",
    }
    given = [flag for flag, value in others.items() if value]
    if given:
        print(
            f"fedctl bench: --workload tiers runs its own two phases; it does not take {', '.join(given)}",
            file=sys.stderr,
        )
        return 2
    args.max_in_flight = args.max_in_flight or scenarios.MAX_IN_FLIGHT
    config = bench_config(args.config, args.speed, args.policy, args.stream_interval)
    log_dir = (args.json.parent if args.json else Path(".")) / "bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report = tiers.run(args, samples, config, log_dir / "tiers.log")
    return _write({**report, "stream_interval": config.stream_interval}, args.json)


def _loadgen(args: argparse.Namespace, samples: list[Sample]) -> int:
    from federation.bench.loadgen import run_loadgen

    def go(endpoint: str, speed: float) -> dict:
        rate = args.rate or 1.0
        log_dir = (args.json.parent if args.json else Path(".")) / "loadgen-logs"
        return run_loadgen(
            endpoint, samples, scenario=args.loadgen, target_qps=rate, speed=speed,
            min_duration_s=args.min_duration_s, log_dir=log_dir,
        )  # fmt: skip

    if args.endpoint:
        return _write(go(args.endpoint.rstrip("/"), args.speed or 1.0), args.json)
    config = bench_config(args.config, args.speed, args.policy, args.stream_interval)
    with _federation(config, args.insecure, _truth_workload(args))(None) as (endpoint, _, estimates):
        started = time.monotonic()
        report = go(endpoint, config.speed)
        report["capacity_error"] = estimates.capacity_error((started, time.monotonic()))  # the whole LoadGen run
        return _write({**report, "stream_interval": config.stream_interval}, args.json)


def _write(report: dict[str, Any], path: Path | None) -> int:
    text = json.dumps(report, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0
