"""Routing decisions as pure functions of site loads: tested with plain values, no servers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from federation.wire import RouteDecision, RouteRequest
from federation.work import expected_output_tokens


@dataclass(frozen=True, slots=True)
class SiteLoad:
    site: str
    region: str
    agent_address: str
    capacity_tok_s: float
    outstanding_tokens: int


def least_expected_delay(
    sites: Sequence[SiteLoad], req: RouteRequest, rtt_s: Mapping[tuple[str, str], float]
) -> RouteDecision | None:
    """The site where this request would finish soonest: the work already queued there plus
    this request's, over the site's capacity, plus the WAN round trip from the client's region
    (when the client says where it is). None when no site can take it."""
    work = expected_output_tokens(req.max_tokens)
    best: tuple[float, SiteLoad] | None = None
    for s in sites:
        if s.site in req.exclude_sites or s.capacity_tok_s <= 0:
            continue
        delay = (s.outstanding_tokens + work) / s.capacity_tok_s
        if req.client_region:
            delay += rtt_s.get((req.client_region, s.region), 0.0)
        if best is None or delay < best[0]:
            best = (delay, s)
    if best is None:
        return None
    delay, s = best
    return RouteDecision(s.site, s.agent_address, delay, "least_expected_delay")
