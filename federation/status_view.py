"""What `fedctl status` shows of the federation: the sites as a table or as a JSON object.

`fedctl status` prints it once and `fedctl status --watch` at every state a replica pushes, so
both read the same rows in the same columns; the watch adds a timestamp to each frame.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from core import wire
from core.tiers import Tier
from federation.dashboard.latency import from_samples, quantile

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
            # Its outstanding requests by service tier, as the schedulers count them ({}: not said).
            "outstanding_by_tier": {t.label: n for t, n in zip(Tier, s.outstanding_by_tier, strict=False)},
        }
        for s in state.sites
    ]


TIER_COLUMNS = ("tier", "at_sites", "held", "ok", "refused", "failed", "ttft_p50_ms", "ttft_p99_ms")
_GATEWAY_TIER_FIGURES = {  # from the gateway's /metrics: outcome -> column
    "ok": "ok",
    "refused": "refused",
    "error": "failed",
}


def tier_rows(state: wire.FederationState, gateway_metrics: str | None) -> dict[str, dict]:
    """Each service tier's queue and latency: its requests outstanding at the sites (as the
    schedulers count them: queued or running), and from the gateway's /metrics (None: it did
    not answer; those figures are then None) the requests it holds, those it finished by outcome
    (refused: 429) and their TTFT percentiles since it started, interpolated in the histogram's
    buckets as Prometheus' `histogram_quantile` does."""
    rows = {tier.label: {"tier": tier.label, "at_sites": 0} for tier in Tier}
    for site in state.sites:
        for tier, count in zip(Tier, site.outstanding_by_tier, strict=False):
            rows[tier.label]["at_sites"] += count
    figures: dict[str, dict] = {label: dict.fromkeys(TIER_COLUMNS[2:]) for label in rows}
    if gateway_metrics is not None:
        buckets: dict[str, dict[float, float]] = {label: {} for label in rows}
        for row in figures.values():
            row.update({"held": 0, "ok": 0, "refused": 0, "failed": 0})
        for family in text_string_to_metric_families(gateway_metrics):
            for sample in family.samples:
                row = figures.get(sample.labels.get("tier", ""))
                if row is None:
                    continue
                if sample.name == "federation_gateway_tier_requests_total":
                    column = _GATEWAY_TIER_FIGURES.get(sample.labels.get("outcome", ""))
                    if column:
                        row[column] += int(sample.value)
                elif sample.name == "federation_gateway_tier_held_requests":
                    row["held"] += int(sample.value)
                elif sample.name == "federation_gateway_tier_ttft_seconds_bucket":
                    counts = buckets[sample.labels["tier"]]
                    bound = float(sample.labels["le"])
                    counts[bound] = counts.get(bound, 0.0) + sample.value
        for label, counts in buckets.items():
            for q, column in ((0.5, "ttft_p50_ms"), (0.99, "ttft_p99_ms")):
                seconds = quantile(q, from_samples(counts)) if counts else None
                figures[label][column] = None if seconds is None else round(seconds * 1000, 1)
    return {label: {**rows[label], **figures[label]} for label in rows}


def state_body(state: wire.FederationState, replicas: Mapping[str, str], gateway_metrics: str | None = None) -> dict:
    """`fedctl status --json`'s object when a replica answered."""
    refused = [{"name": r.name, "reason": r.reason, "at_unix_s": round(r.at_unix_s, 3)} for r in state.refused]
    return {
        "model": state.model,
        "sites": site_rows(state),
        "tiers": tier_rows(state, gateway_metrics),
        "refused": refused,
        "schedulers": dict(replicas),
        "degraded": False,
    }


def unreachable_body(replicas: Mapping[str, str], gateway: dict) -> dict:
    """`fedctl status --json`'s object when no replica answered: what the gateway says instead."""
    return {"schedulers": dict(replicas), "degraded": True, "gateway": gateway}


def _table(columns: Sequence[str], rows: Sequence[Mapping]) -> list[str]:
    """Left-aligned columns; a figure not known (None) as "-"."""
    cells = [[("-" if r[c] is None else str(r[c])) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in cells]
    return lines


def state_table(state: wire.FederationState, replicas: Mapping[str, str], gateway_metrics: str | None = None) -> str:
    lines = _table(SITE_COLUMNS, site_rows(state))
    lines += _table(
        TIER_COLUMNS, list(tier_rows(state, gateway_metrics).values())
    )  # no blank line: --watch's frames have them
    if gateway_metrics is None:
        lines.append("(the gateway's /metrics did not answer: its held requests and latencies by tier are not shown)")
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
