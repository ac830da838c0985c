"""What a site can deliver, in output tokens/s.

For now the GPU profile's prior, scaled by the share of workers that are healthy; the
estimator that learns from what a site actually delivers replaces the prior in issue #4.
"""

from __future__ import annotations

# Output tokens/s per GPU in MLPerf Inference 6.1 gpt-oss-120b Server runs (REFERENCE.md §3).
PRIOR_TOK_S_PER_GPU: dict[str, float] = {"mi300x": 3108.0, "mi355x": 14155.0}


def prior_capacity_tok_s(gpu: str, gpus: int) -> float:
    """Raises KeyError for a GPU we have no profile for."""
    return PRIOR_TOK_S_PER_GPU[gpu] * gpus


def current_capacity_tok_s(prior_tok_s: float, healthy_workers: int, total_workers: int) -> float:
    """A site that lost 4 of 16 workers delivers about three quarters of its capacity."""
    if total_workers <= 0:
        return prior_tok_s
    return prior_tok_s * healthy_workers / total_workers
