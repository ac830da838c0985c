"""`fedctl bench`, small: the same seeded work through the federation, each site alone and a
baseline policy, with the issue's JSON keys (the real runs are long; see docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from core.processes import PROJECT_ROOT
from tests.conftest import fedctl
from tests.test_federation import _config

KEYS = {
    "scenario",
    "policy",
    "requests",
    "output_tokens",
    "duration_s",
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "per_site",
    "standalone",
    "federation_efficiency",
}


TWO_SITES = [("kr-mi300x", "ap-northeast-2", "mi300x"), ("us-mi355x", "us-west-2", "mi355x")]


def _run(tmp_path: Path, *args: str, **sites: int) -> dict:
    """`fedctl bench ARGS` on Korea and the US (`sites`: `_config`'s, e.g. gpus); its JSON report."""
    config, _ = _config(tmp_path, TWO_SITES, **sites)
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "federation.cli", "bench", "--config", str(config), *args, "--json", str(out)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _bench(tmp_path: Path, *args: str) -> dict:
    """Fast and coarse: GPUs at ten times real speed, a stream event per 16 steps, short answers."""
    return _run(tmp_path, "--speed", "10", "--stream-interval", "16", "--output-mean", "60", *args)


@pytest.mark.timeout(180)
def test_offline_with_a_baseline(tmp_path: Path) -> None:
    """Offline over 60 samples, 20 open at a time: every request answered with exactly the tokens
    asked for, split over both sites; round robin runs on the same samples. (Each site alone:
    the sustained test below.)"""
    report = _bench(tmp_path, "--requests", "60", "--max-in-flight", "20", "--compare", "round_robin")
    assert KEYS - {"standalone", "federation_efficiency"} <= set(report)
    assert report["scenario"] == "offline" and report["policy"] == "least_expected_delay"
    assert report["requests"] == 60 and report["requests_failed"] == 0, report["errors"]
    assert set(report["per_site"]) == {"kr-mi300x", "us-mi355x"}
    assert sum(s["output_tokens"] for s in report["per_site"].values()) == report["output_tokens"]
    baseline = report["comparisons"]["round_robin"]
    assert baseline["requests_failed"] == 0 and baseline["output_tokens"] == report["output_tokens"]


@pytest.mark.timeout(180)
def test_server_at_a_given_rate(tmp_path: Path) -> None:
    """Server at a stated Poisson rate: latencies are measured from each arrival, and the run
    says whether it met MLPerf's p99 TTFT and TPOT limits."""
    report = _bench(tmp_path, "--scenario", "server", "--rate", "20", "--requests", "40")
    assert isinstance(report["meets_limits"], bool)
    assert report["scenario"] == "server" and report["rate"] == 20
    assert report["requests_failed"] == 0, report["errors"]
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p99_ms"]
    assert 0 < report["tpot_p50_ms"] <= report["tpot_p99_ms"]
    assert report["served_output_tokens_per_s"] > 0  # tokens over the arrivals' span


@pytest.mark.timeout(180)
def test_sustained_offline_measures_a_window(tmp_path: Path) -> None:
    """Sustained Offline: 8 requests kept open (each finished sample replaced at once, so the
    12 samples are sent again and again), measured over the 12 GPU-s window after the warm-up;
    the 8 still open when it ends are cut, their tokens so far counted, and each site alone is
    measured the same way; the efficiency is federated tokens/s over the sum of the standalone ones."""
    report = _bench(
        tmp_path, "--requests", "12", "--max-in-flight", "8", "--sustain-s", "12", "--warmup-s", "6",
        "--compare-standalone",
    )  # fmt: skip
    assert report["sustained"] == {"warmup_s": 6.0, "window_s": 12.0}
    assert report["duration_s"] == 12.0
    assert report["requests"] > 12 and report["requests_failed"] == 0, report["errors"]
    # The 8 open at the end are cut; an answer whose last chunk the client reads in the same
    # instant as the window ends is answered instead (a CI run saw one, a slow machine's two).
    assert 5 <= report["requests_cut"] <= 8 and report["output_tokens"] > 0
    assert report["output_tokens_per_s"] == pytest.approx(report["output_tokens"] / 12.0, rel=1e-3)
    assert all(run["sustained"]["window_s"] == 12.0 for run in report["standalone_runs"].values())
    assert 4 <= sum(run["requests_cut"] for run in report["standalone_runs"].values()) <= 8  # the 8 shared out
    for name, run in report["standalone_runs"].items():  # each site alone: its own estimate's error
        assert set(run["capacity_error"]) == {name}, run["capacity_error"]
        error = run["capacity_error"][name]
        assert error["bins"] >= 1 and math.isfinite(error["max"]) and 0 <= error["mean"] <= error["max"], error
    assert KEYS <= set(report)
    assert set(report["standalone"]) == {"kr-mi300x", "us-mi355x"} and min(report["standalone"].values()) > 0
    expected = report["steady_output_tokens_per_s"] / sum(report["standalone"].values())
    assert report["federation_efficiency"] == pytest.approx(expected, abs=1e-3)


@pytest.mark.timeout(180)
def test_datapath_reports_cpu_per_token_per_hop_beside_the_router(tmp_path: Path) -> None:
    """`--datapath`, small: 24 streams at real speed and per-token pace through the federation,
    then every event as its own chunk, then the real sglang-router over the same workers; the
    issue's keys, each hop's CPU per token measured, nothing failed, the machine's load said."""
    args = ["--datapath", "--speed", "1", "--max-in-flight", "24", "--requests", "120", "--scale-gateways", "2"]
    report = _run(tmp_path, *args, "--output-mean", "60", "--warmup-s", "2", "--sustain-s", "2", gpus=1)
    assert report["stream_interval"] == 1
    for key in ("gateway_cpu_us_per_token", "agent_cpu_us_per_token", "router_cpu_us_per_token"):
        assert report[key] > 0, key
    assert report["tokens_per_s"] > 0 and report["client_events_per_s"] > 0
    assert 0 <= report["overhead_ms_p50"] <= report["overhead_ms_p99"]
    assert 0 < report["route_ms_p50"] <= report["route_ms_p99"]
    assert isinstance(report["saturated"], bool) and 0 < report["machine_busy_share"] <= 1
    waits = report["runqueue_wait_us_per_wakeup"]  # Linux keeps every thread's schedstat
    assert {"gateway", "agent", "scheduler", "emulator", "client"} <= set(waits)
    assert all(w is not None and w >= 0 for w in waits.values()), waits
    for name, phase in report["phases"].items():
        assert phase["requests_failed"] == 0, (name, phase["errors"])
    # The federation phase again with two gateway processes on the one port: both measured.
    scaling = report["gateway_scaling"]
    assert (
        set(scaling) == {"1", "2"} and report["phases"]["federation, 2 gateway processes"]["processes"]["gateway"] == 2
    )
    for run in scaling.values():
        assert (
            run["tokens_per_s"] > 0 and run["gateway_cpu_us_per_token"] > 0 and run["gateway_cores_per_100k_tok_s"] > 0
        )
    assert report["gateway_cores_per_100k_tok_s"] == scaling["1"]["gateway_cores_per_100k_tok_s"]
    # Each agent's reporter process (its multiprocessing child, beside multiprocessing's tracker) is
    # measured as the agent's, the emulated workers it also started as the emulator's.
    processes = report["phases"]["federation"]["processes"]
    sites = len(TWO_SITES)
    assert 2 * sites <= processes["agent"] <= 3 * sites and processes["emulator"] >= sites, processes
    # Chunks on the agent's window carry many of these short steps' tokens; asked for, a chunk per
    # worker event (the emulator merges a step or two when two cores fall behind it).
    phases = report["phases"]
    assert (
        phases["federation every event"]["tokens_per_client_event"] * 3
        < phases["federation"]["tokens_per_client_event"]
    )


def test_a_workloads_flag_given_for_another_is_refused() -> None:
    """`--conversations` belongs to multi-turn, `--gsp-*` to shared-prefix, `--rate` to a Server run:
    elsewhere they would change nothing, so the run is refused before anything starts, saying which."""
    proc = fedctl("bench", "--gsp-num-groups", "4")
    assert proc.returncode == 2 and "--gsp-num-groups is for --workload shared-prefix, not mlperf-like" in proc.stderr
    proc = fedctl("bench", "--workload", "shared-prefix", "--conversations", "4")
    assert proc.returncode == 2 and "--conversations is for --workload multi-turn" in proc.stderr, proc.stderr
    proc = fedctl("bench", "--workload", "multi-turn", "--scenario", "server")  # paced: by what rate?
    assert proc.returncode == 2 and "multi-turn --scenario server needs --rate" in proc.stderr, proc.stderr
    proc = fedctl("bench", "--workload", "multi-turn", "--rate", "20")  # Offline: a rate would change nothing
    assert proc.returncode == 2 and "--rate is for --scenario server or --loadgen" in proc.stderr, proc.stderr
    proc = fedctl("bench", "--workload", "tiers", "--peers", "round_robin")  # its phases are its own
    assert proc.returncode == 2 and "--workload tiers runs its own two phases" in proc.stderr, proc.stderr
    assert "--peers" in proc.stderr


def test_scaling_gateways_out_is_a_datapath_measurement() -> None:
    """`--scale-gateways N` re-runs the datapath's federation phase with N gateway processes: without
    --datapath, or with N below 2, it is refused before anything starts."""
    for args in (["--scale-gateways", "2"], ["--datapath", "--scale-gateways", "1"]):
        proc = fedctl("bench", *args)
        assert proc.returncode == 2 and "--scale-gateways N needs --datapath and N of 2 or more" in proc.stderr


@pytest.mark.timeout(300)
def test_the_reuse_workloads_measure_cache_hits_and_affinity(tmp_path: Path) -> None:
    """SGLang's shared-prefix set and multi-turn conversations, each through the federation and
    round robin: every request answered; the federation finds most prompt tokens in the sites'
    prefix caches and round robin (blind to caches at every level) fewer; a conversation's turns
    stay at its site."""
    groups = ("--gsp-num-groups", "16", "--gsp-output-len", "128")  # SGLang's set, a quarter of its groups
    shared = _bench(
        tmp_path, "--workload", "shared-prefix", *groups, "--max-in-flight", "64", "--compare", "round_robin"
    )
    assert shared["workload"] == "shared-prefix" and shared["requests"] == 16 * 16 and shared["requests_failed"] == 0
    blind = shared["comparisons"]["round_robin"]
    assert shared["cache_hit_rate"] > 0.6 and blind["cache_hit_rate"] < shared["cache_hit_rate"], (
        shared["cache_hit_rate"],
        blind["cache_hit_rate"],
    )
    turns = _bench(tmp_path, "--workload", "multi-turn", "--conversations", "64", "--compare", "round_robin")
    assert turns["conversations"] == 64 and turns["requests"] == 64 * 5
    assert turns["requests_failed"] == 0 and turns["affinity"] >= 0.95 and turns["cache_hit_rate"] > 0.5, turns
    assert turns["comparisons"]["round_robin"]["affinity"] < 0.9
    # Paced as SGLang's bench_multiturn.py paces them: every turn sent, still at its site.
    paced = _bench(
        tmp_path,
        "--workload",
        "multi-turn",
        "--conversations",
        "16",
        "--turns",
        "3",
        "--scenario",
        "server",
        "--rate",
        "200",
    )
    assert paced["requests"] == 16 * 3 and paced["requests_failed"] == 0 and paced["affinity"] >= 0.9, paced


@pytest.mark.timeout(180)
def test_the_tiers_workload_reports_each_tier_and_the_crash(tmp_path: Path) -> None:
    """`--workload tiers`, small (one GPU a site, a second's windows): Offline, then 1.5x its rate
    in priority, default and flex with the smaller site crashed in the middle. Each tier says its
    TTFT and its requests ok, refused and failed; nothing fails; the crash names the site whose
    streams it cut, and the resume order lists the tiers that resumed."""
    args = ["--speed", "0.2", "--output-mean", "60", "--output-sigma", "0", "--workload", "tiers"]
    report = _run(tmp_path, *args, "--warmup-s", "1", "--sustain-s", "1", "--max-in-flight", "2000", gpus=1)
    assert report["workload"] == "tiers" and report["offline_output_tokens_per_s"] > 0
    assert report["steady_output_tokens_per_s"] > 0 and report["steady_over_offline"] > 0
    assert set(report["tiers"]) == {"priority", "default", "flex"}
    for tier, figures in report["tiers"].items():
        assert figures["requests_ok"] > 0 and figures["failed"] == 0, (tier, figures)
        assert figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
    assert report["crash"]["site"] == "kr-mi300x"
    assert set(report["crash"]["resume_order"]) <= {"priority", "default", "flex"}
    assert set(report["meets"]) == {"priority", "flex", "steady", "priority_resumed_first"}
