"""What a drill measured, in one-second bins around the fault: throughput, p99 TTFT and each
site's share, and the PNG that shows them.

Time runs in wall seconds: detection and failover are the control plane's, which the
emulator's `--speed` does not slow. Throughput and TTFT are GPU time, as in `fedctl bench`
(tokens per wall second ÷ speed; TTFT × speed).

Tokens come from the gateway's per-site counter, sampled through the drill (`sampler.py`):
each sample's increase is spread over the time since the one before, and credited to the site
that generated the tokens. TTFT comes from the clients; capacities, statuses and requests in
flight from the schedulers, sampled alongside; each site's true capacity from the drill
(`federation.bench.truth`), at each bin's middle, to compare the estimates with
(`capacity_errors`).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from federation.bench.client import Result
from federation.bench.truth import TruthLine, relative_error
from federation.drills.sampler import Sample

if TYPE_CHECKING:
    from matplotlib.figure import Figure

BIN_S = 1.0  # wall seconds per bin


@dataclass
class Timeline:
    """Bins of wall time; t = 0 is the fault."""

    start_s: float
    speed: float
    tokens: list[float]
    site_tokens: dict[str, list[float]]
    ttft_p99_ms: list[float | None]
    capacity: dict[str, list[float | None]]  # measured, GPU tok/s, mean of the bin's samples
    outstanding: dict[str, list[float | None]]  # requests in flight, mean of the bin's samples
    # True where every sample of the bin saw the site READY (taking new work); None: no sample
    ready: dict[str, list[bool | None]] = field(default_factory=dict)
    truth: dict[str, list[float | None]] = field(default_factory=dict)  # true capacity, GPU tok/s (`set_truth`)
    marks: dict[str, float] = field(default_factory=dict)  # label -> t (wall s from the fault)

    def t(self, i: int) -> float:
        return self.start_s + (i + 0.5) * BIN_S

    def gpu_rate(self, i: int, values: list[float] | None = None) -> float:
        """Bin i's output tokens/s in GPU time."""
        return (self.tokens if values is None else values)[i] / BIN_S / self.speed

    def _bins(self, t0: float, t1: float) -> list[int]:
        return [i for i in range(len(self.tokens)) if t0 <= self.start_s + i * BIN_S and self.t(i) + BIN_S / 2 <= t1]

    def rate(self, t0: float, t1: float) -> float:
        """Output tokens/s (GPU time) between wall seconds t0 and t1 (whole bins)."""
        bins = self._bins(t0, t1)
        return sum(self.gpu_rate(i) for i in bins) / len(bins) if bins else 0.0

    def site_rates(self, t0: float, t1: float) -> dict[str, float]:
        bins = self._bins(t0, t1)
        if not bins:
            return {}
        return {site: sum(self.gpu_rate(i, v) for i in bins) / len(bins) for site, v in self.site_tokens.items()}

    def capacity_means(self, t0: float, t1: float) -> dict[str, float]:
        """Each site's measured capacity (GPU tok/s), averaged over the bins between t0 and t1."""
        return self._means(self.capacity, t0, t1)

    def outstanding_means(self, t0: float, t1: float) -> dict[str, float]:
        return self._means(self.outstanding, t0, t1)

    def truth_means(self, t0: float, t1: float) -> dict[str, float]:
        return self._means(self.truth, t0, t1)

    def set_truth(self, truth: TruthLine) -> None:
        """Each site's true capacity at each bin's middle (None before the site has one)."""
        self.truth = {site: [truth.at(site, self.t(i)) for i in range(len(self.tokens))] for site in truth.sites}

    def capacity_errors(self, windows: Sequence[tuple[float, float]]) -> dict[str, dict[str, float | int]]:
        """Per site, the relative error of its measured capacity against its truth
        (`truth.relative_error`) over the bins of `windows` (wall s from the fault) where it was
        READY throughout and its truth is above 0; a site with no such bin is left out."""
        out = {}
        for site, values in self.capacity.items():
            ready, truth = self.ready.get(site, []), self.truth.get(site, [])
            pairs = [
                (estimate, actual)
                for t0, t1 in windows
                for i in self._bins(t0, t1)
                if i < len(ready) and ready[i] and i < len(truth)
                if (estimate := values[i]) is not None and (actual := truth[i]) is not None
            ]
            error = relative_error(pairs)
            if error is not None:
                out[site] = error
        return out

    def _means(self, series: dict[str, list[float | None]], t0: float, t1: float) -> dict[str, float]:
        out = {}
        for site, values in series.items():
            known = [v for i in self._bins(t0, t1) if (v := values[i]) is not None]
            if known:
                out[site] = sum(known) / len(known)
        return out

    def capacity_settles(self, site: str, target: float, within: float, hold_bins: int = 3) -> float | None:
        """Seconds after the fault until `site`'s measured capacity is within `within` of
        `target` (relative) and stays so for `hold_bins` bins."""
        values = self.capacity.get(site, [])

        def close(i: int) -> bool:
            return values[i] is not None and abs(values[i] - target) <= within * target

        return self._first_run(close, hold_bins)

    def _first_run(self, close: Callable[[int], bool], hold_bins: int) -> float | None:
        for i in range(len(self.tokens) - hold_bins + 1):
            if self.start_s + i * BIN_S >= 0 and all(close(j) for j in range(i, i + hold_bins)):
                return self.start_s + i * BIN_S
        return None

    def first_time_at_least(self, level: float, hold_bins: int = 3) -> float | None:
        """Seconds after the fault until throughput averaged over `hold_bins` bins from then
        reached `level`. Averaged, not each bin: at drill speed a 1-s bin holds about one decode
        step of each emulated GPU (0.05 GPU-s), so single bins swing widely even in steady state
        (docs/BENCHMARKS.md, "The silent drills")."""
        for i in range(len(self.tokens) - hold_bins + 1):
            window = [self.gpu_rate(j) for j in range(i, i + hold_bins)]
            if self.start_s + i * BIN_S >= 0 and sum(window) / hold_bins >= level:
                return self.start_s + i * BIN_S
        return None

    def share_settles(self, site: str, target: float, within: float, hold_bins: int = 3) -> float | None:
        """Seconds after the fault until `site`'s share of the tokens is within `within` of
        `target` (relative; absolute for a target of 0) and stays so for `hold_bins` bins."""
        values = self.site_tokens.get(site, [0.0] * len(self.tokens))

        def close(i: int) -> bool:
            if not self.tokens[i]:
                return False
            share = values[i] / self.tokens[i]
            return abs(share - target) <= (within * target if target else within)

        return self._first_run(close, hold_bins)


def build(results: Sequence[Result], samples: Sequence[Sample], fault_at: float, speed: float, end: float) -> Timeline:
    """Bin the drill: `fault_at` and `end` are time.monotonic(), as are the results' and samples' times."""
    first = min(r.started for r in results)
    start_s = math.floor((first - fault_at) / BIN_S) * BIN_S
    n = max(1, math.ceil((end - fault_at - start_s) / BIN_S))
    sites = sorted({site for sample in samples for site in sample.site_tokens})
    site_tokens: dict[str, list[float]] = {site: [0.0] * n for site in sites}
    ttfts: list[list[float]] = [[] for _ in range(n)]

    def index(t: float) -> int:
        return int((t - fault_at - start_s) // BIN_S)

    for r in results:
        i = index(r.started)
        if r.ok and r.first_token is not None and 0 <= i < n:
            ttfts[i].append((r.first_token - r.started) * speed * 1000)  # GPU ms, as fedctl bench reports
    for before, after in itertools.pairwise(samples):
        a, b = before.at - fault_at - start_s, after.at - fault_at - start_s
        for site in sites:
            _spread(after.site_tokens.get(site, 0.0) - before.site_tokens.get(site, 0.0), a, b, site_tokens[site])
    tokens = [sum(values[i] for values in site_tokens.values()) for i in range(n)]
    p99 = [sorted(v)[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)] if v else None for v in ttfts]
    capacity = _bin_means([{k: v / speed for k, v in s.capacity_tok_s.items()} for s in samples], samples, index, n)
    outstanding = _bin_means([s.outstanding_requests for s in samples], samples, index, n)
    return Timeline(start_s, speed, tokens, site_tokens, p99, capacity, outstanding, _bin_ready(samples, index, n))


def _bin_ready(samples: Sequence[Sample], index: Callable[[float], int], n: int) -> dict[str, list[bool | None]]:
    """Per site and bin, whether every sample in it saw the site READY (None where none was taken)."""
    ready: dict[str, list[bool | None]] = defaultdict(lambda: [None] * n)
    for sample in samples:
        i = index(sample.at)
        if 0 <= i < n:
            for site, status in sample.status.items():
                ready[site][i] = status == "ready" and ready[site][i] is not False
    return dict(ready)


def _bin_means(
    values: Sequence[Mapping[str, float]], samples: Sequence[Sample], index: Callable[[float], int], n: int
) -> dict[str, list[float | None]]:
    """Per site and bin, the mean of the values sampled in it (None where none was)."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * n)
    counts: dict[str, list[int]] = defaultdict(lambda: [0] * n)
    for sample, by_site in zip(samples, values, strict=True):
        i = index(sample.at)
        if 0 <= i < n:
            for site, value in by_site.items():
                sums[site][i] += value
                counts[site][i] += 1
    return {site: [t / c if c else None for t, c in zip(sums[site], counts[site], strict=True)] for site in sums}


def _spread(amount: float, a: float, b: float, bins: list[float]) -> None:
    """Add `amount`, delivered evenly between a and b (seconds from the first bin's start)."""
    if amount <= 0 or b <= a:
        return
    for j in range(max(0, int(a // BIN_S)), min(len(bins), int(b // BIN_S) + 1)):
        overlap = min(b, (j + 1) * BIN_S) - max(a, j * BIN_S)
        if overlap > 0:
            bins[j] += amount * overlap / (b - a)


def plot(timeline: Timeline, title: str, path: Path) -> None:
    fig = figure(timeline, title)  # picks the backend before pyplot is imported
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(timeline: Timeline, title: str) -> Figure:
    """The drill's four panels: throughput, p99 TTFT, shares, and each site's capacity as
    measured (solid) beside its truth (dashed, the same colour); the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [timeline.t(i) for i in range(len(timeline.tokens))]
    fig, (ax1, ax2, ax3, ax4) = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    bins = range(len(xs))
    sites = sorted(set(timeline.site_tokens) | set(timeline.capacity) | set(timeline.truth))
    colors = {site: f"C{i}" for i, site in enumerate(sites)}  # a site's colour in every panel
    ax1.plot(xs, [timeline.gpu_rate(i) / 1000 for i in bins], color="black", label="federation")
    for site, values in sorted(timeline.site_tokens.items()):
        ax1.plot(xs, [timeline.gpu_rate(i, values) / 1000 for i in bins], color=colors[site], label=site)
    ax1.set_ylabel("output k tok/s (GPU time)")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.plot(xs, [v if v is not None else float("nan") for v in timeline.ttft_p99_ms], color="tab:red")
    ax2.set_ylabel("p99 TTFT (GPU ms)")
    totals = [sum(v[i] for v in timeline.site_tokens.values()) for i in range(len(xs))]
    for site, values in sorted(timeline.site_tokens.items()):
        shares = [v / t if t else float("nan") for v, t in zip(values, totals, strict=True)]
        ax3.plot(xs, shares, color=colors[site], label=site)
    capacity_totals = [sum(v[i] or 0.0 for v in timeline.capacity.values()) for i in range(len(xs))]
    for site, values in sorted(timeline.capacity.items()):
        shares = [v / t if v is not None and t else float("nan") for v, t in zip(values, capacity_totals, strict=True)]
        ax3.plot(xs, shares, linestyle=":", color=colors[site], label=f"{site} measured capacity")
        ax4.plot(xs, [v / 1000 if v is not None else float("nan") for v in values], color=colors[site], label=site)
    for site, values in sorted(timeline.truth.items()):
        truth = [v / 1000 if v is not None else float("nan") for v in values]
        ax4.plot(xs, truth, linestyle="--", color=colors[site], label=f"{site} true")
    ax3.set_ylabel("share of tokens")
    ax3.set_ylim(0, 1)
    ax3.legend(loc="upper right", fontsize=8)
    ax4.set_ylabel("capacity, measured\nand true (dashed)\nk tok/s (GPU time)")
    ax4.legend(loc="upper right", fontsize=8)
    ax4.set_xlabel("seconds from the fault")
    for ax in (ax1, ax2, ax3, ax4):
        for label, t in timeline.marks.items():
            ax.axvline(t, color="gray", linestyle="--")
            if ax is ax1:
                ax.annotate(label, (t, ax.get_ylim()[1]), fontsize=8, rotation=90, va="top")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
