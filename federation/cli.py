"""`fedctl`: run and inspect a federation.

fedctl up [--config FILE] [--port 8080] [--speed X]   the embedded default, or FILE's
fedctl status [--json] [--scheduler HOST:PORT]         the sites as the scheduler sees them
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import grpc

from federation import runtime, wire
from federation.config import Config, ConfigError, load
from federation.processes import Child, StartFailed, free_port_block, start_python
from scheduler.policy import POLICIES

READY_WAIT_S = 60.0  # sites must report ready within this long after their agents start
STATUS_TIMEOUT_S = 3.0


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
    return p.parse_args(argv)


class Federation:
    """The processes of one federation on this machine, started in dependency order."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.children: list[Child] = []

    def _start(self, name: str, module: str, args: list[str]) -> Child:
        child = start_python(name, module, args)
        self.children.append(child)
        return child

    def _link(self, name: str, target_port: int, rtt_ms: float) -> str:
        """A WAN link in user space; returns the address to dial instead of the target."""
        host = self.config.host
        port = free_port_block(1, host)
        self._start(
            name,
            "federation.linkproxy",
            ["--listen", f"{host}:{port}", "--target", f"{host}:{target_port}", "--rtt-ms", str(rtt_ms)],
        )
        return f"{host}:{port}"

    def up(self) -> None:
        c = self.config
        scheduler = f"{c.host}:{c.scheduler_port}"
        rtt_args = [f"--rtt-ms={a}:{b}={ms}" for (a, b), ms in c.rtt_ms.items() if a < b]
        scheduler_args = ["--host", c.host, "--port", str(c.scheduler_port), "--model", c.model, "--policy", c.policy]
        self._start("scheduler", "scheduler", [*scheduler_args, *rtt_args])
        for site in c.sites:
            to_scheduler, advertise = scheduler, f"{c.host}:{site.agent_port}"
            rtt = c.rtt_between(site.region, c.scheduler_region)
            if rtt:
                to_scheduler = self._link(f"link {site.name}->scheduler", c.scheduler_port, rtt)
            rtt = c.rtt_between(site.region, c.gateway_region)
            if rtt:
                advertise = self._link(f"link gateway->{site.name}", site.agent_port, rtt)
            self._start(
                f"agent {site.name}",
                "nodes.agent",
                [
                    "--site",
                    site.name,
                    "--region",
                    site.region,
                    "--gpu",
                    site.gpu,
                    "--gpus",
                    str(site.gpus),
                    "--model",
                    c.model,
                    "--host",
                    c.host,
                    "--port",
                    str(site.agent_port),
                    "--advertise",
                    advertise,
                    "--scheduler",
                    to_scheduler,
                    "--emulate",
                    "--speed",
                    str(c.speed),
                    *(["--emulator-port", str(site.worker_port)] if site.worker_port else []),
                ],
            )
        self._start(
            "gateway",
            "federation.gateway",
            [
                "--host",
                c.host,
                "--port",
                str(c.gateway_port),
                "--scheduler",
                scheduler,
                "--model",
                c.model,
            ],
        )
        self._wait_sites_ready(scheduler)

    def _wait_sites_ready(self, scheduler: str) -> None:
        wanted = {s.name for s in self.config.sites}
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline:
            try:
                ready = {s.name for s in fetch_state(scheduler).sites if s.status is wire.SiteStatus.READY}
            except grpc.RpcError:
                ready = set()
            if wanted <= ready:
                return
            dead = [c.name for c in self.children if not c.alive()]
            if dead:
                raise StartFailed(f"{', '.join(dead)} exited during start-up")
            time.sleep(0.2)
        raise StartFailed(f"sites not ready within {READY_WAIT_S:.0f} s: {sorted(wanted)}")

    def down(self) -> None:
        for child in reversed(self.children):
            child.stop()


def fetch_state(scheduler: str) -> wire.FederationState:
    with grpc.insecure_channel(scheduler) as channel:
        stub = wire.SchedulerStub(channel)
        return wire.federation_state_from_pb(stub.GetState(wire.state_request_to_pb(), timeout=STATUS_TIMEOUT_S))


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return cmd_up(args) if args.command == "up" else cmd_status(args)
    except ConfigError as exc:
        print(f"fedctl: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
