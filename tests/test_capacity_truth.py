"""The truth drills and benches measure the capacity estimator against, and the measurement:
a site's truth by hand, each drill's truth through its fault, the error taken only where it
means something, the PNG's truth lines, the CPU starver that never leaves a process stopped,
and `fedctl bench`'s `capacity_error`. Nothing here asserts the estimator's accuracy: the real
drills measure that."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from core.config import load
from federation.bench.client import Result
from federation.bench.truth import TruthLine, relative_error, site_truth_tok_s, site_workloads, workload_of
from federation.bench.workload import MLPERF_LIKE_OUTPUTS, MLPERF_LIKE_PROMPTS, LengthDistribution
from federation.drills import timeline
from federation.drills.faults import SiteBrownout, SiteJoin, SitePartition, Starver
from federation.drills.run import _truth
from federation.drills.sampler import Sample
from scheduler.workload import REFERENCE, Workload
from tests.test_fedctl_bench import _bench


def test_a_sites_truth_by_hand() -> None:
    """Two MI355X on 1,000-token prompts and 200-token answers (fixed): 5 prompt tokens per
    output token, 1,000 + 200/2 = 1,100 of KV per request, so the 1,024 slots bind (the KV pool
    holds 2,781 such requests): a step is 5.1 + 0.057·1024 + 0.0029·1024·1.1 + 0.0097·1024·5 =
    116.39856 ms, 8,797.36 tok/s a GPU; a 4x brownout, a quarter of two. Prompts of 8,000 and
    answers of 2,000 hold 9,000 each: the KV pool binds at 340, a 46.546-ms step."""
    work = workload_of(LengthDistribution(1000, 0.0), LengthDistribution(200, 0.0))
    assert work == Workload(5.0, 1100.0)
    assert site_truth_tok_s("mi355x", 2, work) == pytest.approx(2 * 1000 * 1024 / 116.39856)
    assert site_truth_tok_s("mi355x", 2, work, slowdown=4.0) == pytest.approx(1000 * 1024 / 116.39856 / 2)
    long = workload_of(LengthDistribution(8000, 0.0), LengthDistribution(2000, 0.0))
    assert site_truth_tok_s("mi355x", 1, long) == pytest.approx(1000 * 340 / 46.546)


def test_a_log_normal_workload_is_read_as_the_scheduler_reads_its_reference() -> None:
    """MLPerf-like lengths (log-normal answers, σ 0.8) give the scheduler's own REFERENCE shape:
    the drills' truth and the estimator's workload are the same arithmetic."""
    work = workload_of(MLPERF_LIKE_PROMPTS, MLPERF_LIKE_OUTPUTS)
    assert work.prompt_per_output == pytest.approx(REFERENCE.prompt_per_output)
    assert work.context_per_request == pytest.approx(REFERENCE.context_per_request)


def test_relative_error_skips_a_truth_of_zero() -> None:
    """|estimate − truth| / truth, its mean and max; a truth of 0 (a site that cannot work) is
    not counted, and nothing counted is None."""
    assert relative_error([(110.0, 100.0), (80.0, 100.0), (5.0, 0.0)]) == {"mean": 0.15, "max": 0.2, "bins": 2}
    assert relative_error([(5.0, 0.0)]) is None


def _config():
    return load(None)  # the embedded default: kr-mi300x and us-mi355x, 16 GPUs each


def test_a_drills_truth_follows_its_fault() -> None:
    """A brownout divides the hit site's truth by its slowdown from the fault on; a partition
    takes it to 0 until its heal, then whole again; an added site has one from the fault; the
    other site keeps its own throughout."""
    config, work = _config(), workload_of(MLPERF_LIKE_PROMPTS, LengthDistribution(200, 0.3))
    kr, us = site_truth_tok_s("mi300x", 16, work), site_truth_tok_s("mi355x", 16, work)
    brownout = SiteBrownout("us-mi355x", None)  # type: ignore[arg-type]  # the truth reads no target
    brownout.slowdown = 4.0
    truth = _truth(config, brownout, work, {}, {}, None)
    assert truth.at("us-mi355x", -5.0) == pytest.approx(us) and truth.at("us-mi355x", 1.0) == pytest.approx(us / 4)
    assert truth.at("kr-mi300x", -5.0) == truth.at("kr-mi300x", 30.0) == pytest.approx(kr)
    truth = _truth(config, SitePartition("kr-mi300x", None), work, {}, {}, 20.0)  # type: ignore[arg-type]
    assert [truth.at("kr-mi300x", t) for t in (-1.0, 0.0, 19.9, 20.0)] == pytest.approx([kr, 0.0, 0.0, kr])
    joined = load(None)
    joined = joined.with_gpus({"us-mi355x": 8})  # stands in for a third site: its truth starts at the fault
    truth = _truth(joined, SiteJoin("us-mi355x", None), work, {}, {}, None)  # type: ignore[arg-type]
    assert truth.at("us-mi355x", -1.0) is None and truth.at("us-mi355x", 0.5) == pytest.approx(us / 2)


def test_each_sites_truth_is_on_the_mix_it_completed() -> None:
    """Routing sends long prompts where prefill is cheap: the MI300X site of a drill completed
    ~550-token prompts where the run's were ~1,000, so its truth is on its own mix, before the
    fault and after it; a site that completed too little to say has the run's."""
    work = workload_of(MLPERF_LIKE_PROMPTS, LengthDistribution(200, 0.0))
    short, long = Workload(2.75, 650.0), Workload(5.6, 1230.0)
    results = [Result(i, 0.0, 0.1, 1.0, 200, "kr-mi300x", prompt_tokens=550) for i in range(20)]
    results += [Result(i, 0.0, 0.1, 1.0, 200, "us-mi355x", prompt_tokens=1120, cut=True) for i in range(20)]
    mixes = site_workloads(results)
    assert set(mixes) == {"kr-mi300x"}  # the US answers were cut: no whole one to say its mix by
    mix = mixes["kr-mi300x"]
    assert (mix.prompt_per_output, mix.context_per_request) == pytest.approx((550 / 200, 550 + 200 / 2))
    truth = _truth(_config(), SiteBrownout("us-mi355x", None), work, {"kr-mi300x": short}, {"kr-mi300x": long}, None)  # type: ignore[arg-type]
    kr = truth.at("kr-mi300x", -5.0), truth.at("kr-mi300x", 5.0)
    assert kr == pytest.approx((site_truth_tok_s("mi300x", 16, short), site_truth_tok_s("mi300x", 16, long)))
    assert kr[0] > site_truth_tok_s("mi300x", 16, work) > kr[1]  # less prefill per answer, more answers
    assert truth.at("us-mi355x", -5.0) == pytest.approx(site_truth_tok_s("mi355x", 16, work))


def test_capacity_error_counts_ready_bins_with_a_truth_in_its_windows() -> None:
    """From samples as the drill takes them (a site not READY sampled at 0): the error is taken
    over the before window and from 10 s after the fault, only in bins where the site was READY
    in every sample and its truth is above 0, with the wall estimate read in GPU time (÷ speed).
    Site a: 10 % high before, 20 % low after, wild in between and in a bin half DOWN; site b
    crashes at the fault (truth 0, DOWN): only its exact before bins count."""
    speed, fault_at = 0.5, 100.0
    truth = TruthLine()
    truth.set("a", -math.inf, 1000.0)
    truth.set("b", -math.inf, 2000.0)
    truth.set("b", 0.0, 0.0)
    samples = []
    for k in range(36):  # every 0.5 s from 4 s before the fault to 14 s after
        at = fault_at - 4.0 + 0.25 + 0.5 * k
        t = at - fault_at
        a = 1100.0 if t < 0 else 800.0 if t >= 10 else 9000.0
        a_status = "down" if 11.0 <= t < 11.5 else "ready"
        b_status = "ready" if t < 0 else "down"
        capacity = {"a": a * speed if a_status == "ready" else 0.0, "b": 2000.0 * speed if t < 0 else 0.0}
        samples.append(Sample(at, {}, capacity, {}, {"a": a_status, "b": b_status}))
    results = [Result(0, fault_at - 4.0, None, fault_at - 3.0, 0, "a")]
    line = timeline.build(results, samples, fault_at, speed, fault_at + 14.0)
    line.set_truth(truth)
    assert line.ready["a"][line._bins(11.0, 12.0)[0]] is False
    errors = line.capacity_errors([(-2.0, 0.0), (10.0, 13.0)])
    assert errors == {"a": {"mean": 0.15, "max": 0.2, "bins": 4}, "b": {"mean": 0.0, "max": 0.0, "bins": 2}}


def test_the_png_draws_each_sites_truth_dashed_in_its_estimates_colour() -> None:
    """The capacity panel has, beside each site's measured capacity, its truth: dashed, the
    same colour, in k tok/s (a site's truth drawn where it has none as a gap)."""
    line = timeline.Timeline(
        -2.0, 1.0, [0.0] * 4, {"a": [0.0] * 4, "b": [0.0] * 4}, [None] * 4,
        {"a": [900.0, 1000.0, None, 1100.0], "b": [0.0] * 4}, {},
    )  # fmt: skip
    truth = TruthLine()
    truth.set("a", -math.inf, 1000.0)
    truth.set("b", 0.0, 3000.0)
    line.set_truth(truth)
    fig = timeline.figure(line, "test")
    try:
        capacity_panel = fig.axes[3]
        lines = {ln.get_label(): ln for ln in capacity_panel.get_lines()}
        for site in ("a", "b"):
            assert lines[f"{site} true"].get_linestyle() == "--"
            assert lines[f"{site} true"].get_color() == lines[site].get_color()
        assert list(lines["a true"].get_ydata()) == [1.0] * 4
        b = list(lines["b true"].get_ydata())
        assert math.isnan(b[0]) and math.isnan(b[1]) and b[2:] == [3.0, 3.0]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def _status(proc: subprocess.Popen) -> str:
    return psutil.Process(proc.pid).status()


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_starver_stops_a_process_in_bursts_and_leaves_it_running(sleeper: subprocess.Popen) -> None:
    """40 ms stopped of every 100: the process is seen stopped and seen running again while the
    starver runs; stopped by `stop()` in the middle of a burst, it is left running."""
    starver = Starver(sleeper.pid, 0.04, 0.1)
    starver.start()
    seen = set()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and len(seen) < 2:
        seen.add(_status(sleeper) == psutil.STATUS_STOPPED)
        time.sleep(0.005)
    assert seen == {True, False}
    while _status(sleeper) != psutil.STATUS_STOPPED:  # into a burst
        time.sleep(0.002)
    starver.stop()
    assert starver.stops >= 1 and _status(sleeper) != psutil.STATUS_STOPPED
    time.sleep(0.3)
    assert _status(sleeper) != psutil.STATUS_STOPPED  # and nothing stops it afterwards


def test_the_starver_ends_quietly_when_its_process_dies(sleeper: subprocess.Popen) -> None:
    """A process that dies while starved (a crash in the same drill) ends the starving, no error."""
    starver = Starver(sleeper.pid, 0.04, 0.1)
    starver.start()
    time.sleep(0.2)
    sleeper.kill()
    sleeper.wait()
    time.sleep(0.2)
    starver.stop()
    assert starver.stops >= 1


@pytest.mark.timeout(180)
def test_bench_reports_the_estimators_error_over_its_window(tmp_path: Path) -> None:
    """`fedctl bench` on the embedded federation: `capacity_error`, per site, finite and
    non-negative, over samples of its measured window (here a 40-GPU-s sustained window; each
    site's own run alone has its own: tests/test_fedctl_bench.py's sustained test)."""
    report = _bench(tmp_path, "--requests", "12", "--max-in-flight", "8", "--sustain-s", "40", "--warmup-s", "6")
    assert report["requests_failed"] == 0, report["errors"]
    errors = report["capacity_error"]
    assert set(errors) == {"kr-mi300x", "us-mi355x"}, errors
    for error in errors.values():
        assert set(error) == {"mean", "max", "bins"} and error["bins"] >= 2
        assert math.isfinite(error["max"]) and 0 <= error["mean"] <= error["max"]
