"""Percentiles from a Prometheus histogram's cumulative buckets, over a recent window.

The gateway's TTFT and TPOT histograms count since it started; an operator watching a drill
wants the last minute, so the board keeps snapshots and reads the difference between the newest
and the oldest. A percentile is interpolated inside its bucket as Prometheus'
`histogram_quantile` does, so the page and a Grafana panel agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative counts by upper bound, ascending, the last bound +Inf."""

    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations made after `earlier` (all of them when the bounds changed, or the
        counts went down: the gateway restarted)."""
        if earlier is None or [b for b, _ in earlier.buckets] != [b for b, _ in self.buckets]:
            return self
        diff = tuple((bound, now - then) for (bound, now), (_, then) in zip(self.buckets, earlier.buckets, strict=True))
        return self if any(count < 0 for _, count in diff) else Histogram(diff)


def from_samples(counts: dict[float, float]) -> Histogram:
    """A Histogram from `{le: cumulative count}` as scraped."""
    return Histogram(tuple(sorted(counts.items())))


def quantile(q: float, histogram: Histogram) -> float | None:
    """The q-quantile (0 < q < 1) in seconds; None without observations. Past the last finite
    bound the answer is that bound, as Prometheus says it."""
    total = histogram.count
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in histogram.buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    raise AssertionError("the last bucket counts every observation")
