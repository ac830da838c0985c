"""What each emulated site can truly deliver, and how far the schedulers' estimate is from it.

A drill or bench that starts the embedded federation knows every site's truth at every moment:
the emulator's GPU model for the site's healthy GPUs, on the run's own workload, divided by the
slowdown a brownout puts on its steps:

    truth = healthy GPUs × full_batch_tok_s(PROFILES[gpu], W) ÷ slowdown

in GPU-time output tokens/s (the unit drills and benches report rates in: wall tok/s ÷ speed),
where W is the workload the site runs as `scheduler.workload` reads one: prompt tokens per
output token E[prompt]/E[out], and the KV a running request holds, E[prompt] + E[out²]/(2·E[out])
(long answers stay in the batch longer). Each site's own: routing sends long prompts where
prefill is cheap, so the sites' mixes differ from the run's (`site_workloads`, from the answers
each completed; the run's for a site that completed too few). An operator's federation
(`--endpoint`) has no known truth.

`capacity_error` is the relative error |estimate − truth| / truth of a site's estimate, one
value per sample (a drill: per one-second bin of its timeline), taken only where the site is
READY (taking new work) and its truth is above 0; reported as its mean and max over them, and
how many there were (`bins`).

Here, not in `federation/drills/`, because both use it and the drills already build on the
bench (its workload, client and scenarios): the bench does not import the drills.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from core.gpus import PROFILES
from federation.bench.client import Result
from federation.bench.workload import LengthDistribution
from scheduler.capacity import full_batch_tok_s
from scheduler.workload import Workload

# Output tokens a site must have completed in a window for its own mix to be its truth's.
MIN_SITE_OUTPUT_TOKENS = 2_000


def mean_square(d: LengthDistribution) -> float:
    """E[x²] of a length distribution: a log-normal of mean m and spread σ has m²·e^(σ²); a fixed
    one, m². (Its clipping to [low, high] is left out, as `scheduler.workload` leaves it out of
    REFERENCE: the drills' and benches' bounds clip a negligible tail.)"""
    return d.mean**2 * math.exp(d.sigma**2) if d.sigma > 0 else float(d.mean**2)


def workload_of(prompt: LengthDistribution, output: LengthDistribution) -> Workload:
    """The run's workload as the GPU model reads it (see the module docstring)."""
    return Workload(prompt.mean / output.mean, prompt.mean + mean_square(output) / (2.0 * output.mean))


def site_workloads(results: Iterable[Result]) -> dict[str, Workload]:
    """Each site's mix, from the answers it completed whole (a cut or failed one is not one);
    a site with fewer than MIN_SITE_OUTPUT_TOKENS of them is left out."""
    sums: dict[str, list[float]] = {}  # site -> [answers, prompt, output, output squared]
    for r in results:
        if r.error is None and not r.cut and r.output_tokens > 0:
            s = sums.setdefault(r.site, [0.0, 0.0, 0.0, 0.0])
            s[0] += 1
            s[1] += r.prompt_tokens
            s[2] += r.output_tokens
            s[3] += r.output_tokens**2
    return {
        site: Workload(prompt / output, prompt / n + square / (2.0 * output))
        for site, (n, prompt, output, square) in sums.items()
        if output >= MIN_SITE_OUTPUT_TOKENS
    }


def site_truth_tok_s(gpu: str, healthy_gpus: int, work: Workload, slowdown: float = 1.0) -> float:
    """GPU-time output tokens/s `healthy_gpus` emulated GPUs of `gpu` deliver on `work` with
    their slots (or KV cache) full, each step `slowdown` times longer."""
    return healthy_gpus * full_batch_tok_s(PROFILES[gpu], work) / slowdown


@dataclass
class TruthLine:
    """Each site's truth through a run: a value from a time on (seconds, on whatever clock the
    run keeps: a drill's wall seconds from its fault), constant until the next change; a site
    has none before its first."""

    changes: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # site -> [(from_s, tok/s)]

    def set(self, site: str, from_s: float, tok_s: float) -> None:
        self.changes.setdefault(site, []).append((from_s, tok_s))
        self.changes[site].sort()

    def at(self, site: str, t: float) -> float | None:
        value = None
        for from_s, tok_s in self.changes.get(site, []):
            if from_s > t:
                break
            value = tok_s
        return value

    @property
    def sites(self) -> list[str]:
        return sorted(self.changes)


def relative_error(pairs: Iterable[tuple[float, float]]) -> dict[str, float | int] | None:
    """{"mean", "max", "bins"} of |estimate − truth| / truth over (estimate, truth) pairs whose
    truth is above 0 (None when there is none)."""
    errors = [abs(estimate - truth) / truth for estimate, truth in pairs if truth > 0]
    if not errors:
        return None
    return {"mean": round(sum(errors) / len(errors), 4), "max": round(max(errors), 4), "bins": len(errors)}
