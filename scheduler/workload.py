"""The shape of the work the federation runs, as it shapes a GPU's step: each output token's
share of prefill (prompt tokens per output token) and the KV context a running request holds.

What a site can deliver in output tokens/s depends on it. The 16 MI355X that decode ~215 k
tok/s of MLPerf-like answers (1,278 tokens after 1,000-token prompts) deliver ~140 k of
200-token answers to the same prompts: ~40 % of every step then goes to prefilling the
requests that replace those finishing. A capacity measured on one shape and used for another
makes a site's expected delays read short (it is sent more than it can run) and reads a new
site's proofs in slow start as a slow GPU.

Learned from every site's reports: the prompt and output tokens of the requests they completed,
as their clients asked for them (a resumed answer counts once, its said tokens as output: a
wave of resumes after a failure is the same work re-prefilled, not another workload), and the
KV tokens per running request. One shape for the whole
federation: routing does not choose by shape, so every site runs the same mix, and a site
that just joined has it at once. Until enough has finished, the MLPerf-like shape the GPU
priors were measured on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.wire import SiteReport

# MLPerf gpt-oss-120b (REFERENCE.md): ~1,000 prompt tokens, 1,278 output tokens on average,
# log-normal lengths (sigma 0.8); a running request is on average half way through its output,
# long ones stay longer: context = prompt + E[out^2] / (2 E[out]).
_PROMPT, _OUTPUT, _SIGMA = 1000.0, 1278.0, 0.8
TIME_CONSTANT_S = 20.0  # finished requests come in bursts; the mix changes slowly
MIN_OUTPUT_TOKENS = 20_000  # finished output tokens (decayed) before the counted mix is used


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_per_output: float
    context_per_request: float


REFERENCE = Workload(_PROMPT / _OUTPUT, _PROMPT + _OUTPUT * math.exp(_SIGMA**2) / 2.0)


class WorkloadMix:
    """Decayed sums of what the sites finished and of what they hold, updated per report."""

    def __init__(self) -> None:
        self._totals: dict[str, tuple[int, int]] = {}  # site -> its last (prompt, output) counters
        self._prompt = self._output = 0.0  # decayed sums of finished tokens
        self._context = self._running = 0.0  # decayed sums of reported KV tokens and running requests
        self._at = 0.0
        self.current = REFERENCE

    def observe(self, report: SiteReport, now: float) -> None:
        last = self._totals.get(report.site)
        self._totals[report.site] = (report.prompt_tokens_total, report.generation_tokens_total)
        if last is None:
            return
        keep = math.exp(-(now - self._at) / TIME_CONSTANT_S) if self._at else 1.0
        self._at = now
        # A counter lower than before: the agent restarted and counts from 0.
        prompt, output = report.prompt_tokens_total - last[0], report.generation_tokens_total - last[1]
        if prompt < 0 or output < 0:
            prompt, output = report.prompt_tokens_total, report.generation_tokens_total
        self._prompt = self._prompt * keep + prompt
        self._output = self._output * keep + output
        self._context = self._context * keep + report.context_tokens
        self._running = self._running * keep + report.running_requests
        if self._output >= MIN_OUTPUT_TOKENS and self._running >= 1:
            self.current = Workload(self._prompt / self._output, self._context / self._running)

    def forget(self, site: str) -> None:
        self._totals.pop(site, None)
