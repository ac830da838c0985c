"""A federation of simulated sites routed by the real policy (core/policy.py), a tick at a time.

Clients in every region send requests to their region's gateway; each is routed as the
scheduler would: the policy is given every ready site's load as the scheduler knows it, which is
its last report (every `report_s`) plus the routes decided since, the measured capacity, the
declared prior, the slots and the prefill speed. A site that dies is noticed after `detect_s`:
what it held is routed again and resumes elsewhere, re-prefilling what it had said. A site that
joins is offered at its prior until its capacity has been measured (`probe_s`), as the
estimator does.

The shortcuts, said once here: a site's measured capacity is its truth (its own run alone)
times a draw of the estimator's error; the scheduler replicas, the agents and the WAN's losses
are not simulated, only its round trips; answers stream to no one, so a request's only times
are its first token (TTFT at the client, round trips included) and its end.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from core.policy import POLICIES, RouteContext, SiteLoad
from core.wire import RouteRequest
from core.work import expected_output_tokens
from federation.bench.workload import MLPERF_LIKE_OUTPUTS, MLPERF_LIKE_PROMPTS
from federation.simulate.site import Request, SiteModel
from federation.simulate.world import SimSite

REPORT_S = 1.0  # an agent's report cadence
DETECT_S = 1.0  # a dead site's streams fail over this long after it died (drills: ~0.3-1 s)
PROBE_S = 15.0  # a new site is offered at its prior until its capacity has been measured
ESTIMATE_ERROR = 0.03  # the measured capacity's relative error (the drills' mean capacity_error)


@dataclass
class Load:
    """What the clients send: Offline keeps `in_flight` requests outstanding; Server sends at
    `rate_per_s` (Poisson). Clients are spread evenly over `regions`."""

    regions: tuple[str, ...]
    in_flight: int = 0
    rate_per_s: float = 0.0


@dataclass
class Events:
    """Faults and joins at given times (simulated seconds)."""

    fail_at: dict[float, tuple[str, ...]] = field(default_factory=dict)  # when -> sites that die
    join_at: dict[float, tuple[SimSite, ...]] = field(default_factory=dict)  # when -> sites that join


@dataclass
class Result:
    dt: float
    tokens: dict[str, np.ndarray]  # output tokens per tick, per site
    first_tokens: list[tuple[float, float]]  # (sent at, TTFT) of every first token, in seconds
    sent_at: list[float]  # when each request was sent
    sent: int
    finished: int
    resumed: int
    unfinished: int  # held anywhere at the end (not lost: still being served)

    def rate(self, start_s: float, end_s: float, sites: Sequence[str] | None = None) -> float:
        """Output tokens/s over [start_s, end_s) of `sites` (default: all)."""
        a, b = int(start_s / self.dt), int(end_s / self.dt)
        names = self.tokens if sites is None else sites
        return sum(float(self.tokens[n][a:b].sum()) for n in names) / (end_s - start_s)

    def ttft_s(self, start_s: float, end_s: float, q: float) -> float:
        """The q-th percentile of the TTFT of the requests sent in [start_s, end_s); a request
        that had no first token by the end counts as infinitely late."""
        sent = sum(1 for t in self.sent_at if start_s <= t < end_s)
        ttfts = sorted(ttft for at, ttft in self.first_tokens if start_s <= at < end_s)
        if not sent:
            return float("nan")
        rank = max(0, int(np.ceil(q / 100.0 * sent)) - 1)
        return ttfts[rank] if rank < len(ttfts) else float("inf")


class Simulation:
    def __init__(
        self,
        sites: Sequence[SimSite],
        policy: str,
        rtt_s: dict[tuple[str, str], float],
        measured_tok_s: dict[str, float],
        seed: int = 0,
        dt: float = 0.1,
    ) -> None:
        self.rtt = rtt_s
        self.dt = dt
        self.policy = POLICIES[policy]
        self.measured = measured_tok_s  # each site's capacity as its estimator would say it
        self.models: dict[str, SiteModel] = {}
        self.ready: list[str] = []  # offered to the policy, in order
        self._joined_at: dict[str, float] = {}
        self._rng = random.Random(seed)
        self._np_rng = np.random.default_rng(seed)
        self._loads: list[SiteLoad] = []
        self._turn = 0
        self._rid = 0
        self._held: deque[Request] = deque()  # at the gateways: not routed yet
        for s in sites:
            self._add(s, 0.0)

    def _add(self, spec: SimSite, now: float) -> None:
        self.models[spec.name] = SiteModel(spec, lambda a, b: self.rtt[(a, b)])
        self.ready.append(spec.name)
        self._joined_at[spec.name] = now

    def _report(self, now: float) -> None:
        """Every ready site's load as the scheduler has it after the sites' reports."""
        loads = []
        for name in self.ready:
            m, spec = self.models[name], self.models[name].spec
            measured = now - self._joined_at[name] >= PROBE_S or self._joined_at[name] == 0.0
            capacity = self.measured[name] if measured else spec.prior_tok_s
            loads.append(
                SiteLoad(
                    name,
                    spec.region,
                    name,
                    capacity,
                    m.outstanding_tokens(),
                    m.held,
                    spec.prior_tok_s,
                    m.slots,
                    m.profile.rho_ms / 1000.0 * spec.prior_tok_s / capacity,
                )
            )
        self._loads = loads

    def _route(self, request: Request, now: float) -> bool:
        req = RouteRequest(str(request.rid), request.prompt + request.said, 0, request.region)
        decision = self.policy(self._loads, req, RouteContext(self.rtt, self._turn))
        if decision is None:
            return False
        self._turn += 1
        i = self.ready.index(decision.site)
        self.models[decision.site].send(request, now)
        s = self._loads[i]  # the route counted until the next report (built whole: replace() costs 5x)
        self._loads[i] = SiteLoad(
            s.site,
            s.region,
            s.agent_address,
            s.capacity_tok_s,
            s.outstanding_tokens + request.expected,
            s.outstanding_requests + 1,
            s.prior_capacity_tok_s,
            s.slots,
            s.prefill_s_per_token,
            s.window,
        )
        return True

    def _new_request(self, region: str, now: float) -> Request:
        self._rid += 1
        prompt, target = MLPERF_LIKE_PROMPTS.draw(self._rng), MLPERF_LIKE_OUTPUTS.draw(self._rng)
        return Request(self._rid, region, prompt, target, expected_output_tokens(0), now)

    def run(self, load: Load, duration_s: float, events: Events | None = None) -> Result:
        events = events or Events()
        ticks = round(duration_s / self.dt)
        every = [*self.models, *(s.name for sites in events.join_at.values() for s in sites)]
        tokens = {name: np.zeros(ticks) for name in every}
        firsts: list[tuple[float, float]] = []
        sent_at: list[float] = []
        failing: list[tuple[float, list[Request]]] = []
        sent = finished = resumed = 0
        outstanding = 0  # sent and not finished
        next_report = 0.0
        for k in range(ticks):
            now = k * self.dt
            for at, names in events.fail_at.items():
                if at <= now < at + self.dt:
                    for name in names:
                        self.ready.remove(name)
                        failing.append((now + DETECT_S, self.models[name].fail()))
                    next_report = now
            for at, specs in events.join_at.items():
                if at <= now < at + self.dt:
                    for spec in specs:
                        self._add(spec, now)
                    next_report = now
            for _, requests in [f for f in failing if f[0] <= now]:
                resumed += len(requests)
                self._held.extend(requests)
            failing = [f for f in failing if f[0] > now]
            if now >= next_report:
                self._report(now)
                next_report = now + REPORT_S
            new = load.in_flight - outstanding if load.in_flight else self._np_rng.poisson(load.rate_per_s * self.dt)
            for _ in range(max(0, new)):
                self._held.append(self._new_request(load.regions[self._rid % len(load.regions)], now))
                sent_at.append(now)
                sent += 1
                outstanding += 1
            while self._held and self._route(self._held[0], now):
                self._held.popleft()
            for name in list(self.ready):
                m = self.models[name]
                before = m.delivered
                done = m.tick(now, self.dt)
                tokens[name][k] = m.delivered - before
                finished += len(done)
                outstanding -= len(done)
                firsts.extend(m.first_tokens)
                m.first_tokens.clear()
        return Result(self.dt, tokens, firsts, sent_at, sent, finished, resumed, outstanding)


def alone(
    sites: Sequence[SimSite], rtt_s: dict[tuple[str, str], float], duration_s: float, seed: int, dt: float
) -> Result:
    """Every site alone, kept full from its own region (its slots and a quarter more): what each
    delivers on its own, the truth a federation's efficiency is measured against."""
    results = []
    for spec in sites:
        sim = Simulation([spec], "round_robin", rtt_s, {spec.name: spec.prior_tok_s}, seed, dt)
        slots = sim.models[spec.name].slots
        results.append(sim.run(Load((spec.region,), in_flight=slots + slots // 4), duration_s))
    merged = {name: r.tokens[name] for r in results for name in r.tokens}
    return Result(
        dt,
        merged,
        [t for r in results for t in r.first_tokens],
        [t for r in results for t in r.sent_at],
        sum(r.sent for r in results),
        sum(r.finished for r in results),
        0,
        sum(r.unfinished for r in results),
    )


def measured_capacities(truth: dict[str, float], seed: int, error: float = ESTIMATE_ERROR) -> dict[str, float]:
    """Each site's truth as its estimator would say it: off by a normal draw of `error`."""
    rng = random.Random(seed)
    return {name: tok_s * (1.0 + rng.gauss(0.0, error)) for name, tok_s in truth.items()}
