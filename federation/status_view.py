"""What `fedctl status` shows of the federation: the sites as a table or as a JSON object.

`fedctl status` prints it once and `fedctl status --watch` at every state a replica pushes, so
both read the same rows in the same columns; the watch adds a timestamp to each frame.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from core import wire

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
    "admit_window",
    "outstanding_requests",
    "queued_requests",
    "routed_requests",
    # Added later: at the end, so the columns scripts read by position stay where they were.
    "loading_workers",
    "weight_format",
    "agent_ceiling_tok_s",
    "clock_speed",
)

CLEAR_SCREEN = "\x1b[2J\x1b[H"  # erase the terminal, cursor to its top left: the next frame replaces this one


def site_rows(state: wire.FederationState) -> list[dict]:
    return [
        {
            "name": s.name,
            "region": s.region,
            "gpu": s.gpu,
            "gpus": s.gpus,
            "weight_format": s.weight_format or "?",
            "checkpoint": s.checkpoint,
            "state": s.status.label,
            "capacity_tok_s": round(s.capacity_tok_s, 1),
            "capacity_evidence": s.capacity_evidence,
            "prior_capacity_tok_s": round(s.prior_capacity_tok_s, 1),
            "healthy_workers": s.healthy_workers,
            "loading_workers": s.loading_workers,
            "total_workers": s.total_workers,
            "slots": s.slots,
            "admit_window": s.admit_window,
            "outstanding_requests": s.outstanding_requests,
            "queued_requests": s.queued_requests,
            "routed_requests": s.routed_requests,
            # What the site's agent can relay, while it runs at a whole core and caps the site (0: not).
            "agent_ceiling_tok_s": round(s.agent_ceiling_tok_s, 1),
            # The clock the capacities are in: 1 for real GPUs, an emulated site's --speed.
            "clock_speed": s.clock_speed,
        }
        for s in state.sites
    ]


def state_body(state: wire.FederationState, replicas: Mapping[str, str]) -> dict:
    """`fedctl status --json`'s object when a replica answered."""
    refused = [{"name": r.name, "reason": r.reason, "at_unix_s": round(r.at_unix_s, 3)} for r in state.refused]
    return {
        "model": state.model,
        "sites": site_rows(state),
        "refused": refused,
        "schedulers": dict(replicas),
        "degraded": False,
    }


def unreachable_body(replicas: Mapping[str, str], gateway: dict) -> dict:
    """`fedctl status --json`'s object when no replica answered: what the gateway says instead."""
    return {"schedulers": dict(replicas), "degraded": True, "gateway": gateway}


def state_table(state: wire.FederationState, replicas: Mapping[str, str]) -> str:
    rows = site_rows(state)
    widths = {c: max([len(c), *(len(str(r[c])) for r in rows)]) for c in SITE_COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in SITE_COLUMNS)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in SITE_COLUMNS) for r in rows]
    for r in state.refused:
        lines.append(f"refused {r.name} at {time.strftime('%H:%M:%S', time.localtime(r.at_unix_s))}: {r.reason}")
    lines.append(schedulers_line(replicas))
    return "\n".join(lines)


def schedulers_line(replicas: Mapping[str, str]) -> str:
    return "schedulers: " + ", ".join(f"{a} {status}" for a, status in replicas.items())


def unreachable_lines(addresses: Sequence[str], gateway: dict) -> list[str]:
    """Why there is no table: no replica answered, and whether the gateway routes on regardless."""
    lines = [f"no scheduler replica reachable ({', '.join(addresses)})"]
    if gateway.get("status") == "degraded":
        lines.append("degraded: the gateway routes from the last state it saw")
    return lines


def frame(text: str, at_unix_s: float, terminal: bool, first: bool) -> str:
    """One update of `fedctl status --watch`, timestamped: on a terminal it replaces the last;
    elsewhere (a pipe, a file) the updates follow each other, a blank line apart."""
    stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at_unix_s))}\n{text}"
    if terminal:
        return CLEAR_SCREEN + stamped
    return stamped if first else "\n" + stamped
