"""`fedctl simulate`: the federation at a scale this machine cannot run for real, two ways.

- `fedctl simulate --sites 64,256,1024`: the control plane. The real scheduler replicas
  (processes, gRPC, mutual TLS) under the reports of N simulated sites and the Route load of G
  gateways (federation/simulate/control.py).
- `fedctl simulate --policy-quality --sites 64`: the routing policy. No processes: a
  discrete-event simulation over the GPU models and the real `core/policy.py`
  (federation/simulate/policy_quality.py).

A flag of one mode given with the other is refused (exit 2), not ignored.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core import runtime

# Each mode's own flags, with their defaults: the other mode refuses them.
POLICY_FLAGS = {"added": 8, "server_load": 0.8, "dt": 0.1}  # 8: the "8 sites added"
CONTROL_FLAGS = {
    "replicas": 2,
    "gateways": 4,
    "routes_per_s": 2000.0,
    "agent_processes": 2,
    "route_gather_ms": runtime.ROUTE_GATHER_S * 1000.0,
    "png": None,
}
# The flags both share, whose defaults differ: simulated seconds for the policy, real ones for the control plane.
DEFAULTS = {True: {"warmup_s": 240.0, "window_s": 120.0}, False: {"warmup_s": 10.0, "window_s": 30.0}}


def _site_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of sites or a comma-separated list, got {text!r}"
        ) from None
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"each run needs at least 2 sites, got {text!r}")
    return counts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy-quality",
        action="store_true",
        help="simulate the policy (no processes): Offline efficiency, Server TTFT, a region lost, sites added",
    )
    p.add_argument(
        "--sites", type=_site_counts, default=[64], help="sites; the control plane takes a list: 64,256,1024"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slower-share", type=float, default=0.3, help="share of sites slower than they declare")
    p.add_argument(
        "--warmup-s",
        type=runtime.positive_float,
        default=None,
        help="seconds before measuring (policy: simulated, 240; control plane: 10)",
    )
    p.add_argument(
        "--window-s",
        type=runtime.positive_float,
        default=None,
        help="seconds measured (policy: simulated, 120; control plane: 30)",
    )
    p.add_argument("--json", type=Path, default=None)
    policy = p.add_argument_group("--policy-quality only")
    policy.add_argument("--added", type=runtime.positive_int, default=None, help="sites that join in the window (8)")
    policy.add_argument(
        "--server-load", type=float, default=None, help="Server: arrivals as a share of the sites' sum (0.8)"
    )
    policy.add_argument("--dt", type=runtime.positive_float, default=None, help="simulated seconds per tick (0.1)")
    control = p.add_argument_group("the control plane only")
    control.add_argument("--replicas", type=runtime.positive_int, default=None, help="scheduler replicas (2)")
    control.add_argument(
        "--gateways", type=runtime.positive_int, default=None, help="gateways whose routes are sent (4)"
    )
    control.add_argument(
        "--routes-per-s", type=runtime.positive_float, default=None, help="routes asked a second, in all (2000)"
    )
    control.add_argument(
        "--agent-processes", type=runtime.positive_int, default=None, help="processes the sites share (2)"
    )
    control.add_argument(
        "--route-gather-ms",
        type=runtime.non_negative_float,
        default=None,
        help=f"a gateway sends a replica at most one RouteStream message per this long "
        f"(default: the gateway's, {runtime.ROUTE_GATHER_S * 1000:g})",
    )
    control.add_argument("--png", type=Path, default=None, help="draw each measure against the number of sites")


def main(args: argparse.Namespace) -> int:
    mine, theirs = (POLICY_FLAGS, CONTROL_FLAGS) if args.policy_quality else (CONTROL_FLAGS, POLICY_FLAGS)
    mode = "--policy-quality" if args.policy_quality else "the control plane (without --policy-quality)"
    for name in theirs:
        if getattr(args, name) is not None:
            print(f"fedctl simulate: --{name.replace('_', '-')} is not a flag of {mode}", file=sys.stderr)
            return 2
    for name, default in {**mine, **DEFAULTS[args.policy_quality]}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if not 0.0 <= args.slower_share <= 1.0:
        print("fedctl simulate: --slower-share must be in [0, 1]", file=sys.stderr)
        return 2
    if args.policy_quality:
        from federation.simulate import policy_quality

        return policy_quality.main(args)
    from federation.simulate import control

    return control.run(args)
