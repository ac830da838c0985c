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
KV tokens per running request. One shape per site: routing charges each site the prefill a
request costs at its measured speed, so long prompts go where prefill is cheap, and each site
runs a mix of its own (measured in the drills: prompts of ~550 tokens at the MI300X site, ~1,130
at the MI355X one, for a federation-wide ~1,000). A site that has finished too little to say
(one that just joined) has the federation's mix; until enough has finished anywhere, the
MLPerf-like shape the GPU priors were measured on. A site that has said its shape and then
finishes too little for a while keeps the shape it last said, as the federation's mix does: one
back from an outage runs only young requests, which finish little for minutes, and what
routing sends it did not change while it was away (the site-blackhole drill read Korea on the
federation's mix, US-shaped, 13 % low, until its end).

A site's completions say its mix only once they keep pace with what it relays (STEADY_FRACTION):
a site that joined, or whose share is growing, has only young requests, and the ones that
finish first are the short answers. Their prompt per output token is high (9 where the site
truly ran 5.3, in the add-site drill), and read as its mix they cut its capacity by a quarter
for minutes. Until then it has the federation's mix, or keeps the shape it last said.
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
STEADY_FRACTION = 0.9  # a site's finished output over what it relayed, before its mix is its own


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_per_output: float
    context_per_request: float


REFERENCE = Workload(_PROMPT / _OUTPUT, _PROMPT + _OUTPUT * math.exp(_SIGMA**2) / 2.0)


@dataclass(slots=True)
class _Sums:
    """Decayed sums of finished prompt and output tokens, output tokens relayed, reported KV
    tokens and running requests."""

    prompt: float = 0.0
    output: float = 0.0
    relayed: float = 0.0
    context: float = 0.0
    running: float = 0.0
    at: float = 0.0

    def add(self, prompt: int, output: int, relayed: int, context: int, running: int, now: float) -> None:
        keep = math.exp(-(now - self.at) / TIME_CONSTANT_S) if self.at else 1.0
        self.at = now
        self.prompt = self.prompt * keep + prompt
        self.output = self.output * keep + output
        self.relayed = self.relayed * keep + relayed
        self.context = self.context * keep + context
        self.running = self.running * keep + running

    @property
    def steady(self) -> bool:
        """Finishing as much output as it relays: not a young population's short answers first."""
        return self.output >= STEADY_FRACTION * self.relayed

    def shape(self) -> Workload | None:
        """The mix these sums say, once they hold enough finished work to say it."""
        if self.output >= MIN_OUTPUT_TOKENS and self.running >= 1:
            return Workload(self.prompt / self.output, self.context / self.running)
        return None


class WorkloadMix:
    """Each site's mix and the federation's, from decayed sums updated per report."""

    def __init__(self) -> None:
        self._totals: dict[str, tuple[int, int, int]] = {}  # site -> its last (prompt, output, relayed) counters
        self._federation = _Sums()
        self._sites: dict[str, _Sums] = {}
        self._shapes: dict[str, Workload] = {}  # each site's mix, as it last said it
        self.current = REFERENCE  # the federation's mix

    def observe(self, report: SiteReport, now: float) -> None:
        last = self._totals.get(report.site)
        totals = (report.prompt_tokens_total, report.generation_tokens_total, report.relayed_tokens_total)
        self._totals[report.site] = totals
        if last is None:
            return
        # A counter lower than before: the agent restarted and counts it from 0.
        prompt, output, relayed = (
            total - then if total >= then else total for total, then in zip(totals, last, strict=True)
        )
        site = self._sites.setdefault(report.site, _Sums())
        # The KV per running request, from a report that says both: one that runs requests and
        # says no KV (an agent that cannot read it) would make the mix's context 0.
        running = report.running_requests if report.context_tokens > 0 else 0
        for sums in (self._federation, site):
            sums.add(prompt, output, relayed, report.context_tokens if running else 0, running, now)
        self.current = self._federation.shape() or self.current
        if site.steady and (shape := site.shape()) is not None:
            self._shapes[report.site] = shape

    def of(self, site: str) -> Workload:
        """The mix `site` runs: its own as it last said it, else the federation's."""
        return self._shapes.get(site) or self.current

    def forget(self, site: str) -> None:
        self._totals.pop(site, None)
        self._sites.pop(site, None)
        self._shapes.pop(site, None)
