"""Measured, not declared: how fast a site's share follows a change in what it can deliver.

Starts the embedded federation slowed down as `fedctl bench` does, keeps it busy with
Offline-like load of short answers, then changes the US site under load and watches the
scheduler:

    python3 scripts/capacity_shift.py slow  --json bench-results/capacity-slow.json
    python3 scripts/capacity_shift.py lose4 --json bench-results/capacity-lose4.json

`slow`: every MI355X worker of us-mi355x becomes 4.08x slower (an MI300X's speed, by the
emulator's calibrated ratio) while the site is still declared 16 x MI355X. `lose4`: 4 of its
16 workers die. Reports the seconds until the site's capacity estimate, and its share of new
routes, are within 10 % of their new true values (capacity: the estimate before the change
scaled by 1/4.08 or by 12/16; share: proportional to the capacities then). Times are GPU
time (wall x speed), like fedctl bench's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
import urllib.request
from pathlib import Path

from federation.admin import fetch_state
from federation.bench import scenarios
from federation.bench.run import bench_config
from federation.bench.workload import LengthDistribution, WorkloadSpec
from federation.embedded import running
from federation.processes import free_port_block

MI355X_OVER_MI300X = 4.08  # the emulator's calibrated ratio (docs/BENCHMARKS.md, fidelity)
WARMUP_GPU_S = 30.0  # past the opening burst's prefill, when estimates read it as slowness
WATCH_GPU_S = 35.0
# Short answers, so requests finish and new ones are routed all the time: the share of new
# routes is what follows capacity (MLPerf-length answers would route nothing for a minute).
ANSWERS = LengthDistribution(600, 0.3)
SAMPLE_S = 0.5
WITHIN = 0.10
SITE = "us-mi355x"


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("change", choices=["slow", "lose4"])
    p.add_argument("--speed", type=float, default=0.25)  # ~130 requests/s at the gateway
    p.add_argument("--requests", type=int, default=60_000)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    base = bench_config(argparse.Namespace(config=None, speed=args.speed, policy="least_expected_delay",
                                           stream_chunk_ms=4000.0))  # fmt: skip
    us_port = free_port_block(16)
    config = dataclasses.replace(
        base, sites=tuple(dataclasses.replace(s, worker_port=us_port) if s.name == SITE else s for s in base.sites)
    )
    workers = [f"http://{config.host}:{us_port + i}" for i in range(16)]
    scheduler = f"{config.host}:{config.scheduler_port}"
    samples = WorkloadSpec(args.requests, seed=1, output=ANSWERS).samples()
    log = Path("bench-logs") / f"capacity-{args.change}.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("a") as log_file, running(config, log_file) as endpoint:
        load = threading.Thread(
            target=scenarios.run_plan,
            args=(endpoint, scenarios.offline_plan(samples), scenarios.MAX_IN_FLIGHT, "load"),
            daemon=True,
        )
        load.start()
        timeline = []
        start = time.monotonic()
        changed_at = start + WARMUP_GPU_S / args.speed
        before = None
        while time.monotonic() < changed_at + WATCH_GPU_S / args.speed:
            state = {s.name: s for s in fetch_state(scheduler).sites}
            now = time.monotonic()
            timeline.append(
                {
                    "t_s": round((now - changed_at) * args.speed, 2),
                    "capacity": {n: round(s.capacity_tok_s) for n, s in state.items()},
                    "routed": {n: s.routed_requests for n, s in state.items()},
                }
            )
            if before is None and now >= changed_at:
                before = {n: s.capacity_tok_s for n, s in state.items()}
                if args.change == "slow":
                    for url in workers:
                        _post(url + "/_emulator/faults", {"slowdown": MI355X_OVER_MI300X})
                else:
                    for url in workers[:4]:
                        _post(url + "/_emulator/die", {})
            time.sleep(SAMPLE_S)
    factor = 1 / MI355X_OVER_MI300X if args.change == "slow" else 12 / 16
    report = _converge(timeline, before, factor)
    report.update(change=args.change, speed=args.speed, capacity_before=before)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**report, "timeline": timeline}, indent=2) + "\n")
    return 0


def _converge(timeline: list[dict], before: dict[str, float], factor: float) -> dict:
    """Seconds after the change until the estimate, and the share of routes over a 2 s window,
    are (and stay) within 10 % of the new truth."""
    target_capacity = before[SITE] * factor
    others = sum(c for n, c in before.items() if n != SITE)
    target_share = target_capacity / (target_capacity + others)
    after = [row for row in timeline if row["t_s"] >= 0]

    def settled(ok: list[bool]) -> float | None:
        for i in range(len(ok)):
            if all(ok[i:]):
                return after[i]["t_s"]
        return None

    capacity_ok = [abs(row["capacity"][SITE] / target_capacity - 1) <= WITHIN for row in after]
    shares, share_ok = [], []
    window = max(1, round(2.0 / SAMPLE_S))
    for i, row in enumerate(after):
        prev = after[max(0, i - window)]["routed"]
        new = {n: row["routed"][n] - prev[n] for n in row["routed"]}
        total = sum(new.values())
        share = new[SITE] / total if total else None
        shares.append(share)
        full_window = i >= window
        share_ok.append(full_window and share is not None and abs(share / target_share - 1) <= WITHIN)
    return {
        "target_capacity_tok_s": round(target_capacity),
        "target_share": round(target_share, 4),
        "capacity_within_10pct_after_s": settled(capacity_ok),
        "share_within_10pct_after_s": settled(share_ok),
        "final_capacity_tok_s": after[-1]["capacity"][SITE] if after else None,
        "final_share": shares[-1] if shares else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
