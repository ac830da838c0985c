"""The schedulers' capacity estimates through a bench run on the embedded federation, against
each site's truth (`truth.py`).

A thread asks the schedulers for their sites' state every half second (what `fedctl status`
reads) while the federation runs. `capacity_error` then compares, over a run's measured
window (a sustained run's window; Offline's steady window; a Server run's arrivals), each
sample's estimate of each READY site (wall tok/s ÷ speed: GPU time) with the site's truth on
the workload it ran (truth.py): {site: {mean, max, bins}}, `bins` the samples counted. A site with none
is left out. Runs with no scheduler (`--peers`: the sglang-router) have no such key; against
`--endpoint` the truth is unknown, and the report says so (`capacity_error` null,
`capacity_error_note`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from core.wire import SiteState, SiteStatus
from federation.bench.truth import relative_error, site_truth_tok_s
from scheduler.workload import Workload

SAMPLE_INTERVAL_S = 0.5  # as a drill's sampler: several samples within the estimator's 5-s time constant
NO_TRUTH = "unknown: --endpoint measures a federation whose GPUs' truth the bench cannot know"


@dataclass(frozen=True, slots=True)
class Estimates:
    at: float  # time.monotonic() when asked
    ready_tok_s: dict[str, float]  # each READY site's estimate, wall tok/s


@dataclass
class EstimateSampler:
    """Samples `states()` until stopped; `gpus`: each site's GPU type and count, whose truth is
    measured on the workload the site ran (the run's `work` when it ran too little to say)."""

    states: Callable[[], dict[str, SiteState]]
    gpus: dict[str, tuple[str, int]]
    work: Workload
    speed: float
    samples: list[Estimates] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="bench estimate sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic()
            try:
                states = self.states()
            except grpc.RpcError:
                states = {}  # no replica answered: no sample
            ready = {name: s.capacity_tok_s for name, s in states.items() if s.status is SiteStatus.READY}
            if ready:
                self.samples.append(Estimates(asked, ready))
            self._stop.wait(max(0.0, SAMPLE_INTERVAL_S - (time.monotonic() - asked)))

    def capacity_error(
        self, window: tuple[float, float] | None, works: Mapping[str, Workload] | None = None
    ) -> dict[str, dict[str, float | int]]:
        """Per site, the relative error of its samples within `window` (time.monotonic()) against
        its truth on `works`' mix for it (truth.site_workloads)."""
        if window is None:
            return {}
        inside = [s for s in self.samples if window[0] <= s.at <= window[1]]
        out = {}
        for site, (gpu, gpus) in sorted(self.gpus.items()):
            truth = site_truth_tok_s(gpu, gpus, (works or {}).get(site, self.work))
            pairs = [(s.ready_tok_s[site] / self.speed, truth) for s in inside if site in s.ready_tok_s]
            error = relative_error(pairs)
            if error is not None:
                out[site] = error
        return out
