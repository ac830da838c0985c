"""Routing decisions as pure functions of site loads: tested with plain values, no servers.

`least_expected_delay` is the federation's policy; the others are the baselines every
benchmark measures beside it, so the difference is shown, not claimed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from federation.wire import RouteDecision, RouteRequest
from federation.work import expected_output_tokens


@dataclass(frozen=True, slots=True)
class SiteLoad:
    site: str
    region: str
    agent_address: str
    capacity_tok_s: float  # measured
    outstanding_tokens: int
    outstanding_requests: int = 0
    prior_capacity_tok_s: float = 0.0  # declared: GPU profile x GPU count


@dataclass(frozen=True, slots=True)
class RouteContext:
    rtt_s: Mapping[tuple[str, str], float]
    turn: int  # how many decisions came before this one (round robin)


Policy = Callable[[Sequence[SiteLoad], RouteRequest, RouteContext], RouteDecision | None]


def _candidates(sites: Sequence[SiteLoad], req: RouteRequest) -> list[SiteLoad]:
    return [s for s in sites if s.site not in req.exclude_sites and s.capacity_tok_s > 0]


def _pick(name: str, scored: list[tuple[float, SiteLoad]]) -> RouteDecision | None:
    if not scored:
        return None
    score, s = min(scored, key=lambda pair: pair[0])
    return RouteDecision(s.site, s.agent_address, score, name)


def least_expected_delay(sites: Sequence[SiteLoad], req: RouteRequest, ctx: RouteContext) -> RouteDecision | None:
    """The site where this request would finish soonest: the work already queued there plus
    this request's, over the site's measured capacity, plus the WAN round trip from the
    client's region (when the client says where it is). None when no site can take it."""
    work = expected_output_tokens(req.max_tokens)

    def delay(s: SiteLoad) -> float:
        wan = ctx.rtt_s.get((req.client_region, s.region), 0.0) if req.client_region else 0.0
        return (s.outstanding_tokens + work) / s.capacity_tok_s + wan

    return _pick("least_expected_delay", [(delay(s), s) for s in _candidates(sites, req)])


def round_robin(sites: Sequence[SiteLoad], req: RouteRequest, ctx: RouteContext) -> RouteDecision | None:
    """Baseline: each site in turn, blind to capacity and load."""
    candidates = sorted(_candidates(sites, req), key=lambda s: s.site)
    if not candidates:
        return None
    s = candidates[ctx.turn % len(candidates)]
    return RouteDecision(s.site, s.agent_address, 0.0, "round_robin")


def least_outstanding(sites: Sequence[SiteLoad], req: RouteRequest, ctx: RouteContext) -> RouteDecision | None:
    """Baseline: the site with the fewest requests in flight, blind to capacity."""
    return _pick("least_outstanding", [(float(s.outstanding_requests), s) for s in _candidates(sites, req)])


def static_weights(sites: Sequence[SiteLoad], req: RouteRequest, ctx: RouteContext) -> RouteDecision | None:
    """Baseline: work over the *declared* capacity (GPU profile x count), never measured."""
    work = expected_output_tokens(req.max_tokens)
    scored = [
        ((s.outstanding_tokens + work) / s.prior_capacity_tok_s, s)
        for s in _candidates(sites, req)
        if s.prior_capacity_tok_s > 0
    ]
    return _pick("static_weights", scored)


POLICIES: dict[str, Policy] = {
    "least_expected_delay": least_expected_delay,
    "round_robin": round_robin,
    "least_outstanding": least_outstanding,
    "static_weights": static_weights,
}
