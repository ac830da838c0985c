"""What a drill watches all through: the gateway's counters and the schedulers' estimates.

The tokens each site relayed to clients are counted by the gateway as they pass
(`federation_gateway_output_tokens_total{site}`), so sampling that counter every half second
shows each site's throughput and share as it was, chunk by chunk, credited to the site that
generated the tokens — which the clients' own records cannot: a stream's tokens arrive over
its whole life, and a resumed answer is finished by another site. Beside it, each site's
capacity as the scheduler measures it (0 while it takes no new work), which the share is to
follow, and its status (the estimate is measured against the truth only while READY).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families

from core.wire import SiteState, SiteStatus

SAMPLE_INTERVAL_S = 0.5  # twice per timeline bin
SCRAPE_TIMEOUT_S = 5.0
SITE_TOKENS = "federation_gateway_output_tokens_total"


def gateway_counters(metrics_url: str) -> dict[str, float]:
    """Every counter the gateway exports, by name (a labelled one as `name{label=value}`)."""
    with urllib.request.urlopen(metrics_url, timeout=SCRAPE_TIMEOUT_S) as resp:
        text = resp.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                name = f"{sample.name}{{{labels}}}" if labels else sample.name
                counts[name] = counts.get(name, 0.0) + sample.value
    return counts


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # time.monotonic(), the middle of the scrape
    site_tokens: dict[str, float]  # cumulative output tokens relayed, by site
    capacity_tok_s: dict[str, float]  # measured (wall time), 0 for a site taking no new work; {}: unknown
    outstanding_requests: dict[str, int]  # in flight at each site, as the scheduler counts them
    status: dict[str, str] = field(default_factory=dict)  # each site's status label (ready, down, ...)


def site_tokens(counts: dict[str, float]) -> dict[str, float]:
    prefix = SITE_TOKENS + "{site="
    return {name[len(prefix) : -1]: value for name, value in counts.items() if name.startswith(prefix)}


@dataclass
class SiteTokenSampler:
    """A thread that samples the per-site token counter and the capacities until stopped."""

    metrics_url: str
    states: Callable[[], dict[str, SiteState]]
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="drill token sampler", daemon=True)
        self._thread.start()

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic()
            try:
                counts = gateway_counters(self.metrics_url)
            except (OSError, ValueError):  # URLError is an OSError
                pass  # a gateway busy past the timeout, or gone: the gap spreads over the next sample
            else:
                at = (asked + time.monotonic()) / 2
                try:
                    states = self.states()
                except grpc.RpcError:
                    states = {}  # no replica answered (a scheduler-crash drill)
                capacities = {
                    name: s.capacity_tok_s if s.status is SiteStatus.READY else 0.0 for name, s in states.items()
                }
                outstanding = {name: s.outstanding_requests for name, s in states.items()}
                status = {name: s.status.label for name, s in states.items()}
                self.samples.append(Sample(at, site_tokens(counts), capacities, outstanding, status))
            self._stop.wait(max(0.0, SAMPLE_INTERVAL_S - (time.monotonic() - asked)))
