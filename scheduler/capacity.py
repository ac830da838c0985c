"""What a site can deliver, in output tokens/s: a prior to start from, then what it proves.

The GPU profile × GPU count is only where the estimate starts. A site whose workers have
requests waiting is saturated, and a saturated site delivers exactly its capacity, so the
estimate moves toward the delivered rate. A site with room to spare only shows a lower
bound: the estimate rises when it delivers more than believed and never falls for lack of
work. The estimate is kept per healthy worker, so a site that loses workers loses that
share at once, while a slow site loses share as fast as it proves it is slow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from federation.wire import SiteReport

# Output tokens/s per GPU in MLPerf Inference 6.1 gpt-oss-120b Server runs (REFERENCE.md §3).
PRIOR_TOK_S_PER_GPU: dict[str, float] = {"mi300x": 3108.0, "mi355x": 14155.0}
# How fast a saturated site's delivered rate replaces the estimate: ~95 % after three time
# constants (15 s), inside the 30 s a mis-declared site may keep a wrong share.
TIME_CONSTANT_S = 5.0
MAX_STEP_S = 2.0  # a long gap between reports must not count as a long observation
# SGLang's gen_throughput averages over recent seconds: only once a site has been saturated
# for that long does the rate it shows reflect saturation rather than the idle time before.
SETTLE_S = 5.0


def prior_capacity_tok_s(gpu: str, gpus: int) -> float:
    """Raises KeyError for a GPU we have no profile for."""
    return PRIOR_TOK_S_PER_GPU[gpu] * gpus


@dataclass(slots=True)
class CapacityEstimator:
    prior_tok_s: float
    full_site_tok_s: float  # the estimate with every worker healthy
    saturated_for_s: float = 0.0

    @classmethod
    def from_prior(cls, prior_tok_s: float) -> CapacityEstimator:
        return cls(prior_tok_s, prior_tok_s)

    def observe(self, report: SiteReport, dt_s: float) -> None:
        """Learn from one report covering `dt_s` seconds."""
        if report.healthy_workers <= 0 or report.total_workers <= 0 or dt_s <= 0:
            return
        full_site = report.gen_throughput_tok_s * report.total_workers / report.healthy_workers
        self.saturated_for_s = self.saturated_for_s + dt_s if report.queued_requests > 0 else 0.0
        if self.saturated_for_s >= SETTLE_S or full_site > self.full_site_tok_s:
            weight = 1.0 - math.exp(-min(dt_s, MAX_STEP_S) / TIME_CONSTANT_S)
            self.full_site_tok_s += weight * (full_site - self.full_site_tok_s)

    def capacity_tok_s(self, healthy_workers: int, total_workers: int) -> float:
        """What the site delivers now: a site that lost 4 of 16 workers, three quarters."""
        if total_workers <= 0:
            return self.full_site_tok_s
        return self.full_site_tok_s * healthy_workers / total_workers
