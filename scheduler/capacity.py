"""What a site can deliver, in output tokens/s: a prior to start from, then what it proves.

The GPU profile × GPU count is only where the estimate starts. Three kinds of evidence then
move it, every report:

- A site whose requests wait while its slots (or its KV cache) are full is saturated, and a
  saturated site delivers exactly its capacity: the estimate moves toward the delivered rate.
  A queue beside free room is only requests waiting for the next step to admit them.
- A site with room to spare still shows how fast it runs the batch it has, each step also
  prefilling at least its share of the requests that replace those finishing (a few of them
  always wait for the next step, the more so the slower the step: a queue alone is no reason
  to stop reading), and up to a full chunk while many wait. Its workers' step at that batch
  (running requests over tokens/s) against the step the GPU profile predicts for the same
  batch, context and prefill says how much faster or slower the site is than declared; what the declared GPUs' model delivers, scaled by that ratio, is the
  estimate. So a site declared MI355X that runs like an MI300X loses its share before it
  ever queues.
- A site delivering more than believed, held for 10 s, proves at least the least it delivered
  over those seconds (a burst relayed late after a stall proves nothing).

And one that does not wait for tokens: a busy site whose step in progress has run 1.75 times as long
as its recent steps (`core.pace`) is running slower now, by at least that much. Its tokens come
only at the step's end, so everything above learns of a brownout seconds late; while a step
overruns, the capacity is cut to recent step / age (`step_factor`), and the cut ends with the
step, the evidence above taking over.

The rate is what the site's agent relayed over its last 5 s (`delivered_tok_s`).

The estimate is kept per healthy worker, so a site that loses workers loses that share
at once, while a slow site loses share as fast as it proves it is slow.

It is kept for the reference workload the priors were measured on (MLPerf-like) and scaled,
when asked, to the workload the federation runs now (`scheduler.workload`): the GPU model says
what the same GPUs deliver on each, so evidence gathered on one shape of work still holds when
the shape changes, and each step's prefill is counted when reading how fast a site decodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core import pace
from core.gpus import PROFILES, GpuProfile
from core.wire import SiteReport
from scheduler.workload import REFERENCE, Workload, WorkloadMix

# Output tokens/s per GPU in MLPerf Inference 6.1 gpt-oss-120b Server runs (REFERENCE.md §3).
PRIOR_TOK_S_PER_GPU: dict[str, float] = {"mi300x": 3108.0, "mi355x": 14155.0}
# How fast evidence replaces the estimate: ~95 % after three time constants (15 s), inside
# the 30 s a mis-declared site may keep a wrong share.
TIME_CONSTANT_S = 5.0
MAX_STEP_S = 2.0  # a long gap between reports must not count as a long observation
# The delivered rate is averaged over the agent's last 5 s (nodes.agent.delivered): only once a
# site has been busy for that long does the rate it shows belong to the batch it runs rather
# than the time before.
SETTLE_S = 5.0
# The batch is averaged over about the same recent window as the delivered rate (a 5 s boxcar
# lags by 2.5 s on average), so the two describe the same seconds.
BATCH_TIME_CONSTANT_S = 2.5
# More delivered than believed raises the estimate once held this long, to the least delivered
# meanwhile: twice the rate's 5 s window, so a burst of tokens held up by a stalled loop
# (relayed late, all at once) has left the window before it could count.
ABOVE_HELD_S = 2 * SETTLE_S
# This many requests waiting per worker (~1k-token prompts) fill a prefill chunk (16,384 tokens):
# a step then carries a full chunk. Fewer waiting fill part of one.
QUEUE_FOR_FULL_CHUNKS = 16
# Below this many requests per worker the step is mostly fixed cost and launch jitter: too
# little to scale a whole site's capacity from.
MIN_BATCH_PER_WORKER = 8.0
# Full: a site holding this much of its slots' worth of requests (decoding, prefilling or
# waiting at its workers), or using this much of its KV cache. A wave of arrivals queues for a
# moment at a site with thousands of free slots; read as saturation, its low delivered rate
# cut the US site's estimate by a third in a bench run, and its share with it.
FULL_FRACTION = 0.95


def prior_capacity_tok_s(gpu: str, gpus: int) -> float:
    """Raises KeyError for a GPU we have no profile for."""
    return PRIOR_TOK_S_PER_GPU[gpu] * gpus


def decode_speed_ratio(
    profile: GpuProfile, batch: float, context_tokens: float, tok_s: float, prefill_tokens: float = 0.0
) -> float:
    """How many times faster than `profile` a GPU is that makes `tok_s` output tokens/s while
    decoding `batch` requests holding `context_tokens` of KV, each step also prefilling
    `prefill_tokens` (all per GPU)."""
    measured_step_ms = 1000.0 * batch / tok_s
    return profile.step_ms(round(batch), round(context_tokens), round(prefill_tokens)) / measured_step_ms


def full_batch_tok_s(profile: GpuProfile, work: Workload) -> float:
    """What one GPU of `profile` delivers on `work` with its slots full (or its KV cache)."""
    batch = min(profile.max_running_requests, profile.kv_capacity_tokens / work.context_per_request)
    return 1000.0 * batch / profile.mixed_step_ms(batch, work.context_per_request, work.prompt_per_output)


def _full(report: SiteReport) -> bool:
    """As many requests as slots, or the KV cache (nearly) in use; a site that does not say its
    slots, if it queues. Prompts being prefilled count: SGLang shows them as waiting, not running."""
    held = report.running_requests + report.queued_requests
    slots_full = report.slots <= 0 or held >= FULL_FRACTION * report.slots
    return slots_full or report.kv_usage >= FULL_FRACTION


@dataclass(slots=True)
class CapacityEstimator:
    prior_tok_s: float
    full_site_tok_s: float  # the estimate with every worker healthy
    profile: GpuProfile | None = None  # the declared GPU's step model: the shape batch evidence is read with
    gpus: int = 0
    saturated_for_s: float = 0.0
    busy_for_s: float = 0.0
    above_for_s: float = 0.0  # how long the site has delivered more than the estimate
    above_least_tok_s: float = math.inf  # the least it delivered over that time
    batch_per_worker: float = 0.0  # recent average
    context_per_worker: float = 0.0
    evidence: str = "prior"  # what the estimate last moved on: prior, probe, batch, saturated, delivered
    # While the step in progress overruns the site's pace: the share of its pace it runs at now
    # (recent step / step so far, core.pace). 1 otherwise.
    step_factor: float = 1.0
    mix: WorkloadMix | None = None  # the federation's workload; None: the reference one

    @classmethod
    def for_site(cls, gpu: str, gpus: int, mix: WorkloadMix | None = None) -> CapacityEstimator:
        prior = prior_capacity_tok_s(gpu, gpus)
        return cls(prior, prior, PROFILES.get(gpu), gpus, mix=mix)

    @property
    def declared_model_tok_s(self) -> float:
        """The declared GPUs on the reference workload as their step model has them: what a
        speed read through that model (probe, batch) scales."""
        if self.profile is None or self.gpus <= 0:
            return self.prior_tok_s
        return self.gpus * full_batch_tok_s(self.profile, REFERENCE)

    def workload_factor(self) -> float:
        """What the site delivers on the federation's workload over what it delivers on the
        reference one (the unit the estimate is kept in)."""
        if self.profile is None or self.mix is None:
            return 1.0
        return full_batch_tok_s(self.profile, self.mix.current) / full_batch_tok_s(self.profile, REFERENCE)

    def calibrate(self, batch_per_worker: float, context_per_worker: float, tok_s_per_worker: float) -> None:
        """A probe's result, when the site joins: the estimate starts from it instead of the prior."""
        if self.profile is None or batch_per_worker <= 0 or tok_s_per_worker <= 0:
            return
        ratio = decode_speed_ratio(self.profile, batch_per_worker, context_per_worker, tok_s_per_worker)
        self.full_site_tok_s = self.declared_model_tok_s * ratio
        self.evidence = "probe"

    def observe(self, report: SiteReport, dt_s: float) -> None:
        """Learn from one report covering `dt_s` seconds."""
        healthy, total = report.healthy_workers, report.total_workers
        if healthy <= 0 or total <= 0 or dt_s <= 0:
            return
        per_worker_tok_s = report.delivered_tok_s / healthy
        delivered_full_site = per_worker_tok_s * total / self.workload_factor()  # as if on the reference workload
        follow = 1.0 - math.exp(-min(dt_s, BATCH_TIME_CONSTANT_S) / BATCH_TIME_CONSTANT_S)
        self.batch_per_worker += follow * (report.running_requests / healthy - self.batch_per_worker)
        self.context_per_worker += follow * (report.context_tokens / healthy - self.context_per_worker)
        self.saturated_for_s = self.saturated_for_s + dt_s if report.queued_requests > 0 and _full(report) else 0.0
        busy = report.running_requests / healthy >= MIN_BATCH_PER_WORKER
        self.busy_for_s = self.busy_for_s + dt_s if busy else 0.0
        # Read only once busy and settled, as the batch is: a site filling up runs long steps.
        self.step_factor = pace.overrun_factor(report) if self.busy_for_s >= SETTLE_S else 1.0

        held_above_s = self._held_above(delivered_full_site, dt_s)
        if self.saturated_for_s >= SETTLE_S:
            seen, evidence = delivered_full_site, "saturated"
        elif self.busy_for_s >= SETTLE_S and self.profile is not None and per_worker_tok_s > 0:
            prefill = self._prefill_per_step(self.profile, report.queued_requests / healthy)
            ratio = decode_speed_ratio(
                self.profile, self.batch_per_worker, self.context_per_worker, per_worker_tok_s, prefill
            )
            seen, evidence = self.declared_model_tok_s * ratio, "batch"
        elif held_above_s >= ABOVE_HELD_S:
            seen, evidence = self.above_least_tok_s, "delivered"  # more than believed is proof, busy or not
        else:
            return
        weight = 1.0 - math.exp(-min(dt_s, MAX_STEP_S) / TIME_CONSTANT_S)
        self.full_site_tok_s += weight * (seen - self.full_site_tok_s)
        self.evidence = evidence

    @property
    def overdue(self) -> bool:
        return self.step_factor < 1.0

    def _prefill_per_step(self, profile: GpuProfile, queued_per_worker: float) -> float:
        """Prompt tokens each step prefills besides its decode, per worker: at least the share of
        the prompts replacing the requests that finish (a few of them are always waiting for the
        next step, the more so the slower the step); more while more wait (a wave, or a site
        sent more than it runs), counted as ~1k-token prompts, up to a full chunk."""
        prompt_per_output = self.mix.current.prompt_per_output if self.mix is not None else 0.0
        replacing = self.batch_per_worker * prompt_per_output
        chunk = float(profile.chunked_prefill_tokens)
        waiting = min(chunk, queued_per_worker * chunk / QUEUE_FOR_FULL_CHUNKS)
        return max(replacing, waiting)

    def _held_above(self, delivered_tok_s: float, dt_s: float) -> float:
        """Seconds the site has delivered more than the estimate, to now; the least of it is kept."""
        if delivered_tok_s <= self.full_site_tok_s:
            self.above_for_s, self.above_least_tok_s = 0.0, math.inf
        else:
            self.above_for_s += dt_s
            self.above_least_tok_s = min(self.above_least_tok_s, delivered_tok_s)
        return self.above_for_s

    def prefill_s_per_token(self) -> float:
        """The GPU's prefill cost per prompt token, at the speed the site has shown."""
        if self.profile is None or self.full_site_tok_s <= 0:
            return 0.0
        return self.profile.rho_ms / 1000.0 * self.declared_model_tok_s / self.full_site_tok_s

    def capacity_tok_s(self, healthy_workers: int, total_workers: int) -> float:
        """What the site delivers now, on the federation's workload: a site that lost 4 of 16
        workers, three quarters."""
        full = self.full_site_tok_s * self.workload_factor() * self.step_factor
        return full if total_workers <= 0 else full * healthy_workers / total_workers
