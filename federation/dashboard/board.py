"""What the page shows, kept in one place and fed by the watch, the scrapes and the marks.

The board turns the schedulers' pushes into each site's row and into events (a site joins,
drains, goes down, comes back, is removed), the gateway's counters into a tokens/s timeline
point per second, resume bursts and TTFT/TPOT percentiles, and a drill's POSTs into marks. It
does no I/O: the server feeds it and sends the page what it returns, as JSON-ready dicts. Every
buffer is bounded: the timeline and the events keep the latest only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from core import wire
from core.config import Config
from federation.dashboard.gateway_scrape import GatewaySample
from federation.dashboard.latency import Histogram, quantile
from federation.dashboard.marks import Mark

TIMELINE_POINTS = 600  # one a second: the last ten minutes
EVENTS_KEPT = 200  # a drill makes a handful; a flapping site must not grow the page without end
SHARE_WINDOW_POINTS = 10  # a site's share of the tokens over the last 10 s: steady, yet quick to follow a change
LATENCY_WINDOW_POINTS = 60  # TTFT/TPOT percentiles over the last minute's requests

# The event a site's new state is, by that state.
STATE_EVENTS = {
    wire.SiteStatus.JOINING: "join",
    wire.SiteStatus.READY: "ready",
    wire.SiteStatus.DRAINING: "drain",
    wire.SiteStatus.DOWN: "down",
}


@dataclass(frozen=True, slots=True)
class Event:
    at_unix_s: float
    kind: str  # join, ready, drain, down, removed, resume, mark
    label: str
    site: str = ""


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    at_unix_s: float
    tok_s: dict[str, float]  # output tokens/s each site delivered since the previous scrape


class Board:
    def __init__(self, config: Config, gateway_url: str) -> None:
        self.config = config
        self.gateway_url = gateway_url
        self.sites: dict[str, wire.SiteState] = {}
        self.model = config.model
        self.scheduler: str | None = None  # the replica watched; None while none answers
        self.seen_state = False
        self.gateway_error: str | None = "not scraped yet"
        self.timeline: deque[TimelinePoint] = deque(maxlen=TIMELINE_POINTS)
        self.events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self._scrapes: deque[GatewaySample] = deque(maxlen=LATENCY_WINDOW_POINTS)

    # ---- what feeds it ----------------------------------------------------------------------

    def on_state(self, state: wire.FederationState, scheduler: str, at_unix_s: float) -> list[Event]:
        """A replica's push; the events it makes (none for the first: that is where we start)."""
        now = {s.name: s for s in state.sites}
        events: list[Event] = []
        if self.seen_state:
            for name, site in now.items():
                before = self.sites.get(name)
                if before is None:
                    events.append(Event(at_unix_s, "join", f"{name} joined", name))
                elif before.status is not site.status:
                    kind = STATE_EVENTS[site.status]
                    events.append(Event(at_unix_s, kind, f"{name} {site.status.label}", name))
            events += [Event(at_unix_s, "removed", f"{n} removed", n) for n in self.sites if n not in now]
        self.sites, self.model, self.scheduler, self.seen_state = now, state.model, scheduler, True
        self.events.extend(events)
        return events

    def on_schedulers_lost(self) -> None:
        """No replica answers: the page keeps the last state and says it is old."""
        self.scheduler = None

    def on_scrape(self, sample: GatewaySample) -> tuple[TimelinePoint | None, list[Event]]:
        """A scrape of the gateway: the timeline's new point (None for the first: a rate needs
        two), and a resume burst's event."""
        self.gateway_error = None
        previous = self._scrapes[-1] if self._scrapes else None
        self._scrapes.append(sample)
        if previous is None or sample.at_unix_s <= previous.at_unix_s:
            return None, []
        elapsed_s = sample.at_unix_s - previous.at_unix_s
        point = TimelinePoint(
            sample.at_unix_s,
            {
                site: _increase(count, previous.site_tokens.get(site, 0.0)) / elapsed_s
                for site, count in sample.site_tokens.items()
            },
        )
        self.timeline.append(point)
        resumed = round(_increase(sample.resumed, previous.resumed))
        events = [Event(sample.at_unix_s, "resume", f"{resumed} resumed")] if resumed else []
        self.events.extend(events)
        return point, events

    def on_gateway_unreachable(self, reason: str) -> None:
        self.gateway_error = reason

    def add_mark(self, mark: Mark) -> Event:
        event = Event(mark.at_unix_s, "mark", mark.label)
        self.events.append(event)
        return event

    # ---- what the page gets -----------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """Everything but the timeline and the events: sent whenever something changes."""
        rates = self._token_rates()
        total_rate = sum(rates.values())
        serving = {n: s.capacity_tok_s if s.status is wire.SiteStatus.READY else 0.0 for n, s in self.sites.items()}
        total_capacity = sum(serving.values())
        latency = self._latency()
        regions: dict[str, list[dict[str, Any]]] = {s.region: [] for s in self.config.sites}
        for name, site in sorted(self.sites.items()):
            regions.setdefault(site.region, []).append(
                {
                    "name": name,
                    "region": site.region,
                    "state": site.status.label,
                    "gpu": site.gpu,
                    "gpus": site.gpus,
                    "healthy_workers": site.healthy_workers,
                    "total_workers": site.total_workers,
                    "capacity_tok_s": site.capacity_tok_s,
                    "prior_capacity_tok_s": site.prior_capacity_tok_s,
                    "capacity_evidence": site.capacity_evidence,
                    "clock_speed": site.clock_speed,  # the time base both capacities are in (1: real GPUs)
                    "agent_ceiling_tok_s": site.agent_ceiling_tok_s,
                    "tok_s": self.timeline[-1].tok_s.get(name, 0.0) if self.timeline else None,
                    "token_share": rates.get(name, 0.0) / total_rate if total_rate else None,
                    "capacity_share": serving[name] / total_capacity if total_capacity else None,
                    **latency.get(name, {}),
                }
            )
        return {
            "model": self.model,
            "scheduler": self.scheduler,
            "seen_state": self.seen_state,
            "gateway": {"url": self.gateway_url, "error": self.gateway_error},
            "gateway_region": self.config.gateway.region,
            "regions": [
                {"name": region, "rtt_ms_to_gateway": self._rtt_ms(region, self.config.gateway.region), "sites": rows}
                for region, rows in regions.items()
            ],
            "links": [
                {"between": [a, b], "rtt_ms": rtt} for (a, b), rtt in sorted(self.config.rtt_ms.items()) if a < b
            ],
        }

    def snapshot(self) -> dict[str, Any]:
        """What a page gets when it connects: the view, the timeline and the events so far."""
        return {
            **self.view(),
            "timeline": [asdict(p) for p in self.timeline],
            "events": [asdict(e) for e in self.events],
            "timeline_points": TIMELINE_POINTS,
            "events_kept": EVENTS_KEPT,
        }

    def _token_rates(self) -> dict[str, float]:
        """Each site's mean tokens/s over the share window."""
        recent = list(self.timeline)[-SHARE_WINDOW_POINTS:]
        sums: dict[str, float] = {}
        for point in recent:
            for site, rate in point.tok_s.items():
                sums[site] = sums.get(site, 0.0) + rate / len(recent)
        return sums

    def _latency(self) -> dict[str, dict[str, float | None]]:
        """TTFT and TPOT p50/p99 per site over the latency window ({} without the histograms)."""
        if not self._scrapes:
            return {}
        oldest, newest = self._scrapes[0], self._scrapes[-1]
        found: dict[str, dict[str, float | None]] = {}
        for name, now, then in (("ttft", newest.ttft, oldest.ttft), ("tpot", newest.tpot, oldest.tpot)):
            for site, histogram in now.items():
                recent: Histogram = histogram.since(then.get(site)) if oldest is not newest else histogram
                found.setdefault(site, {})[f"{name}_p50_s"] = quantile(0.5, recent)
                found[site][f"{name}_p99_s"] = quantile(0.99, recent)
        return found

    def _rtt_ms(self, a: str, b: str) -> float | None:
        return 0.0 if a == b else self.config.rtt_ms.get((a, b))


def _increase(now: float, before: float) -> float:
    """A counter's increase; after a reset (the gateway restarted) all it counts is new."""
    return now - before if now >= before else now
