"""The capacity estimator, fed what real agents reported while something happened to their site
(tests/data/reports/, recorded by scripts/record_reports.py: a real agent over 4 emulated MI300X
at full speed, per-token streams, under load on this 2-core machine): its estimate stays within
reach of the truth through a resume wave after a worker dies, an agent stopped three times for
2 s, a 4-fold brownout, and a join.

The truth at each report is the emulator's GPU model for the workers the agent reported healthy,
at the recording's slowdown, on its workload (1,000-token prompts, 200-token answers). The
estimator before #40 read the agent's timing of tokens; on these same recordings, from 10 s
after the fault, its mean error was 0.18-0.60 and its largest 0.47-1.35 (docs/BENCHMARKS.md),
where these bounds are 0.10 and 0.30: each of these tests fails on it.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from core.gpus import PROFILES
from core.wire import SiteReport, WorkDone
from scheduler.capacity import CapacityEstimator, full_batch_tok_s
from scheduler.workload import Workload, WorkloadMix

RECORDINGS = Path(__file__).parent / "data" / "reports"
SETTLED_S = 10.0  # after the fault (or the join), as the drills measure


def replay(recording: dict) -> list[tuple[float, float, float]]:
    """(seconds from the fault, estimate, truth) at every report, as a scheduler replica sees them."""
    work = recording["workload"]
    shape = Workload(work["prompt_tokens"] / work["output_tokens"], work["prompt_tokens"] + work["output_tokens"] / 2)
    per_gpu = full_batch_tok_s(PROFILES[recording["gpu"]], shape) * recording["clock_speed"]
    registration = recording["registrations"][-1]
    mix = WorkloadMix()
    mix.current = shape  # a federation that serves knows its workload's shape; a site joining it has it at once
    est = CapacityEstimator.for_site(registration["gpu"], registration["gpus"], mix, registration["clock_speed"])
    est.calibrate(registration["probe_batch"], registration["probe_context_tokens"], registration["probe_tok_s"])
    names = {f.name for f in fields(SiteReport)}
    out, last_t = [], None
    for entry in recording["reports"]:
        report = SiteReport(
            **{k: v for k, v in entry.items() if k in names and k != "work"}, work=WorkDone(**entry["work"])
        )
        mix.observe(report, entry["t"])
        if last_t is not None:
            est.observe(report, entry["t"] - last_t)
        last_t = entry["t"]
        slowdown = [x for x in recording["truth"] if x["t"] <= entry["t"]][-1]["slowdown"]
        truth = report.healthy_workers * per_gpu / slowdown
        estimate = est.capacity_tok_s(report.healthy_workers, report.total_workers)
        out.append((entry["t"] - recording["fault_at_s"], estimate, truth))
    return out


def errors(replayed: list[tuple[float, float, float]], start_s: float, end_s: float) -> tuple[float, float]:
    """Mean and largest |estimate - truth| / truth over reports between the two times, where the
    site had a healthy worker."""
    errs = [abs(e - t) / t for at, e, t in replayed if start_s <= at <= end_s and t > 0]
    assert errs, "no report in the window"
    return sum(errs) / len(errs), max(errs)


@pytest.mark.parametrize("scenario", ["resume-wave", "loop-stall", "brownout", "join"])
def test_the_estimate_holds_through_what_the_recording_saw(scenario: str) -> None:
    """Within 0.10 of the truth on average and 0.30 at most, over the 20 s before the fault and
    from 10 s after it to the end of the load (for a join: from 10 s after its load came)."""
    recording = json.loads((RECORDINGS / f"{scenario}.json").read_text())
    replayed = replay(recording)
    windows = [(SETTLED_S, 1e9)] if scenario == "join" else [(-20.0, 0.0), (SETTLED_S, 1e9)]
    for start_s, end_s in windows:
        mean, largest = errors(replayed, start_s, end_s)
        assert mean <= 0.10 and largest <= 0.30, (scenario, start_s, round(mean, 3), round(largest, 3))
