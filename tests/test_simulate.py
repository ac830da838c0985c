"""The policy simulation (`fedctl simulate --policy-quality`): its sites deliver what the GPU
models say, the real policy beats round robin where sites are slower than they declare, a lost
region loses nothing, and the command writes the issue's keys."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from core.gpus import PROFILES
from federation.simulate.des import Events, Load, Simulation, alone, measured_capacities
from federation.simulate.world import REGIONS, SimSite, make_sites, rtt_s

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RTT = rtt_s()
E_OUT_SQ = 1278**2 * math.exp(0.8**2)  # MLPerf-like outputs: log-normal, mean 1,278, sigma 0.8


def test_a_site_alone_delivers_what_its_gpu_model_predicts() -> None:
    """Full and queued, a site's steady output is its GPUs' steady state by core/gpus.py (the
    analytic model leaves out the lengths' clipping: within 5 %)."""
    for gpu in ("mi300x", "mi355x"):
        site = SimSite("s", "us-west-2", gpu, 2)
        delivered = alone([site], RTT, 240.0, 0, 0.1).rate(160.0, 240.0)
        p = PROFILES[gpu]
        tok_s, _ = p.predict_steady_state(p.max_running_requests, 1000, 1278, E_OUT_SQ)
        assert abs(delivered / (2 * tok_s) - 1) < 0.05, (gpu, delivered, 2 * tok_s)


def _world() -> tuple[list[SimSite], dict[str, float]]:
    """Two regions, two sites each; one site of each region at 60 % of what it declares."""
    sites = [
        SimSite("kr-a", "ap-northeast-2", "mi300x", 2),
        SimSite("kr-b", "ap-northeast-2", "mi300x", 2, speed=0.6),
        SimSite("us-a", "us-west-2", "mi355x", 1),
        SimSite("us-b", "us-west-2", "mi355x", 1, speed=0.6),
    ]
    solo = alone(sites, RTT, 150.0, 0, 0.1)
    return sites, measured_capacities({s.name: solo.rate(100.0, 150.0, [s.name]) for s in sites}, 0)


def test_the_policy_starts_requests_sooner_than_round_robin_on_sites_slower_than_declared() -> None:
    """Server at 80 % of what the sites deliver alone: round robin sends the slowest site more
    than it can serve, so once its slots are full (some 280 s in) its queue and its TTFT p99
    grow without bound; the federation's stays under a second. Every request sent is finished
    or still being served."""
    sites, measured = _world()
    regions = ("ap-northeast-2", "us-west-2")
    rate = 0.8 * sum(measured.values()) / 1278
    p99 = {}
    for policy in ("least_expected_delay", "round_robin"):
        r = Simulation(sites, policy, RTT, measured).run(Load(regions, rate_per_s=rate), 480.0)
        assert r.finished + r.unfinished == r.sent > 0
        p99[policy] = r.ttft_s(360.0, 420.0, 99)
    assert p99["least_expected_delay"] < 1.0 and p99["round_robin"] > 5.0, p99


def test_a_lost_region_loses_nothing_and_the_rest_carry_on() -> None:
    """Korea's sites die under Offline load: what they held resumes in the US (re-prefilling
    what it had said), nothing is lost, and the US sites stay full."""
    sites, measured = _world()
    sim = Simulation(sites, "least_expected_delay", RTT, measured)
    r = sim.run(Load(("ap-northeast-2", "us-west-2"), in_flight=3000), 180.0, Events(fail_at={100.0: ("kr-a", "kr-b")}))
    assert r.resumed > 0 and r.finished + r.unfinished == r.sent
    us = ["us-a", "us-b"]
    assert r.rate(130.0, 180.0, us) > 0.9 * sum(measured[n] for n in us)
    assert r.rate(130.0, 180.0, ["kr-a", "kr-b"]) == 0.0


def test_the_world_is_mixed_and_its_round_trips_symmetric() -> None:
    sites = make_sites(64, 0, 0.3)
    assert {s.region for s in sites} == set(REGIONS) and {s.gpu for s in sites} == {"mi300x", "mi355x"}
    assert all(8 <= s.gpus <= 16 for s in sites) and 0 < sum(s.speed < 1 for s in sites) < 64
    assert all(RTT[(a, b)] == RTT[(b, a)] > 0 for a in REGIONS for b in REGIONS)


def test_fedctl_simulate_writes_the_issues_keys(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    sizes = {"--sites": 2, "--added": 1, "--warmup-s": 30, "--window-s": 20}  # a smoke run: seconds
    args = ["--policy-quality", *(str(x) for pair in sizes.items() for x in pair), "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "federation.cli", "simulate", *args],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for key in ("federation_efficiency", "round_robin_efficiency", "static_efficiency"):
        assert 0.0 < report[key] <= 1.1, (key, report[key])
    assert set(report["ttft_p99_ms"]) == {"least_expected_delay", "round_robin", "static_weights"}
    assert report["sites"] == 2 and "region_lost" in report and "sites_added" in report
    bad = subprocess.run(
        [sys.executable, "-m", "federation.cli", "simulate", "--policy-quality", "--slower-share", "2"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--slower-share" in bad.stderr
