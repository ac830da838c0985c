"""`fedctl`: run and inspect a federation.

fedctl up [--config FILE] [--port 8080] [--speed X]   the embedded default, or FILE's
fedctl status [--json] [--scheduler HOST:PORT]         the sites as the scheduler sees them
fedctl bench [--scenario offline|server] [--json FILE]  throughput and latency (fedctl bench -h)
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import grpc

from federation import runtime
from federation.bench import run as bench
from federation.config import ConfigError, load
from federation.embedded import Federation, fetch_state
from federation.processes import StartFailed
from scheduler.policy import POLICIES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="fedctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a federation and serve until Ctrl-C")
    up.add_argument("--config", type=Path, default=None, help="YAML: regions, RTTs, sites, ports")
    up.add_argument("--port", type=int, default=None, help="the gateway's port (default 8080)")
    up.add_argument("--speed", type=runtime.positive_float, default=None, help="emulated GPU speed (0.1 = 10x slower)")
    up.add_argument(
        "--policy", choices=sorted(POLICIES), default=None, help="routing policy (baselines for comparison)"
    )
    status = sub.add_parser("status", help="list the sites")
    status.add_argument("--json", action="store_true")
    status.add_argument("--config", type=Path, default=None)
    status.add_argument("--scheduler", default=None, help="host:port (default: from the config)")
    bench.add_arguments(sub.add_parser("bench", help="measure the federation, its sites alone and the peers"))
    return p.parse_args(argv)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    config = load(args.config).with_overrides(port=args.port, speed=args.speed, policy=args.policy)
    federation = Federation(config)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops us like Ctrl-C, even mid start-up
    try:
        federation.up()
        endpoint = f"http://{config.host}:{config.gateway_port}/v1"
        runtime.announce_ready(endpoint=endpoint, sites=[s.name for s in config.sites], speed=config.speed)
        print(f"federation ready: {endpoint}  (fedctl status; Ctrl-C stops it)", file=sys.stderr, flush=True)
        while True:
            time.sleep(0.5)
            dead = [c.name for c in federation.children if not c.alive()]
            if dead:
                print(f"fedctl: {', '.join(dead)} exited; stopping the federation", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        return 0
    except StartFailed as exc:
        print(f"fedctl: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        federation.down()


SITE_COLUMNS = (
    "name",
    "region",
    "gpu",
    "gpus",
    "state",
    "capacity_tok_s",
    "capacity_evidence",
    "prior_capacity_tok_s",
    "healthy_workers",
    "total_workers",
    "slots",
    "outstanding_requests",
    "queued_requests",
    "routed_requests",
)


def cmd_status(args: argparse.Namespace) -> int:
    config = load(args.config)
    scheduler = args.scheduler or f"{config.host}:{config.scheduler_port}"
    try:
        state = fetch_state(scheduler)
    except grpc.RpcError as exc:
        print(f"fedctl: scheduler {scheduler} unreachable: {exc.code().name}", file=sys.stderr)
        return 1
    rows = [
        {
            "name": s.name,
            "region": s.region,
            "gpu": s.gpu,
            "gpus": s.gpus,
            "state": s.status.label,
            "capacity_tok_s": round(s.capacity_tok_s, 1),
            "capacity_evidence": s.capacity_evidence,
            "prior_capacity_tok_s": round(s.prior_capacity_tok_s, 1),
            "healthy_workers": s.healthy_workers,
            "total_workers": s.total_workers,
            "slots": s.slots,
            "outstanding_requests": s.outstanding_requests,
            "queued_requests": s.queued_requests,
            "routed_requests": s.routed_requests,
        }
        for s in state.sites
    ]
    if args.json:
        print(json.dumps({"model": state.model, "sites": rows}, indent=2))
        return 0
    widths = {c: max([len(c), *(len(str(r[c])) for r in rows)]) for c in SITE_COLUMNS}
    print("  ".join(c.ljust(widths[c]) for c in SITE_COLUMNS))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in SITE_COLUMNS))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl-C: every process the bench started stops too
    try:
        return bench.main(args)
    except KeyboardInterrupt:
        print("fedctl bench: interrupted", file=sys.stderr)
        return 130
    except StartFailed as exc:
        print(f"fedctl bench: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "bench":
            return cmd_bench(args)
        return cmd_up(args) if args.command == "up" else cmd_status(args)
    except ConfigError as exc:
        print(f"fedctl: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
