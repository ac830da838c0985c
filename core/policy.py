"""Routing decisions as pure functions of site loads: tested with plain values, no servers.

`least_expected_delay` is the federation's policy; the others are the baselines every
benchmark measures beside it, so the difference is shown, not claimed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from core.tiers import Tier, ahead_of
from core.wire import RouteDecision, RouteRequest
from core.work import expected_output_tokens


@dataclass(frozen=True, slots=True)
class SiteLoad:
    site: str
    region: str
    agent_address: str
    capacity_tok_s: float  # measured
    outstanding_tokens: int
    outstanding_requests: int = 0
    prior_capacity_tok_s: float = 0.0  # declared: GPU profile x GPU count
    slots: int = 0  # requests its healthy workers run at once; 0: unknown
    prefill_s_per_token: float = 0.0  # measured speed applied to the GPU's prefill cost
    window: int = 0  # slow start: of its slots, how many it has proven it can fill (0: all)
    # Of its outstanding requests, how many of each service tier (Tier's order); (): not said.
    outstanding_by_tier: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RouteContext:
    rtt_s: Mapping[tuple[str, str], float]
    turn: int  # how many decisions came before this one (round robin)
    # Of this request's prompt, the tokens each site likely holds in its prefix cache (the
    # schedulers' directory, core/prefixes.py); a site not named holds none.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)


Policy = Callable[[Sequence[SiteLoad], RouteRequest, RouteContext], RouteDecision | None]


def _candidates(sites: Sequence[SiteLoad], req: RouteRequest) -> list[SiteLoad]:
    return [s for s in sites if s.site not in req.exclude_sites and s.capacity_tok_s > 0]


def _pick(name: str, scored: list[tuple[float, SiteLoad]], delay: Callable[[SiteLoad], float] | None = None):
    """The lowest score wins; the decision carries the expected delay (the score unless told)."""
    if not scored:
        return None
    score, s = min(scored, key=lambda pair: pair[0])
    return RouteDecision(s.site, s.agent_address, score if delay is None else delay(s), name)


# Among sites with free slots, a fuller one is slower for everyone on it (a bigger batch is a
# longer step): one fully loaded site counts this many seconds more than an empty one, so a
# site 10 % fuller than another loses to it unless it is > 100 ms closer.
FILL_PENALTY_S = 1.0

# A cached prefix of at least this many tokens is a hit worth following: the request stays at
# the site holding it, re-prefilling it elsewhere being a miss that stalls every stream of that
# worker's batch, not only this one (so it weighs more than its own prefill). Shorter ones, a
# chat template's header every prompt shares, count only as the prefill they save.
MIN_HIT_TOKENS = 256
# ... while that site is no fuller than the emptiest candidate by more than this share of its
# slots (the sglang-router's cache_aware policy likewise balances before it follows a cache).
# So a long system prompt does not pull all work to the first site that saw it, and a site
# that joins holding nothing is sent work once the others are this much fuller.
HIT_FILL_MARGIN = 0.25


def least_expected_delay(sites: Sequence[SiteLoad], req: RouteRequest, ctx: RouteContext) -> RouteDecision | None:
    """The site where this request would start soonest: the time until a slot frees there (the
    work queued beyond its running slots over its measured capacity), plus the WAN round trip
    from the client's region (when the client says where it is), plus its prefill there (of the
    prompt less what the site likely holds in its prefix cache), plus a small penalty for how
    full the site is. So a request goes where its prefix is cached unless another site would
    start it sooner by more than re-prefilling it there costs, or is emptier by more than that
    (a prefix every prompt shares, a chat template's header, saves next to nothing, so it pulls
    no work to the first site that saw it). A hit of `MIN_HIT_TOKENS` or more keeps the request
    at its holder unless another starts it sooner or the holder is fuller than the emptiest by
    more than `HIT_FILL_MARGIN`: a conversation's history keeps it where it is.
    Sites with free slots fill in proportion to their slots; once all are full, queues grow in
    proportion to capacity — every site saturated, none with an idle slot while another has a
    queue. A request waits only behind the work of its own service tier and the tiers above
    (a site serves its queue by tier), so priority work sees the soonest start for priority work.
    A site in slow start offers only the slots
    it has proven (`window`): beyond them, its requests count as waiting. A flex request
    (core/tiers.py) counts no WAN round trip: it goes where capacity is spare, in any region,
    leaving the near sites' room to the interactive work a round trip matters to. None when no
    site can take it."""
    work = expected_output_tokens(req.max_tokens)
    counts_wan = bool(req.client_region) and req.tier is not Tier.FLEX  # flex: spare capacity, any region

    def delay(s: SiteLoad) -> float:
        """Seconds until this request's first token there: queue, WAN, prefill."""
        wan = ctx.rtt_s.get((req.client_region, s.region), 0.0) if counts_wan else 0.0
        prefill = max(0, req.prompt_tokens - ctx.cached_tokens.get(s.site, 0)) * s.prefill_s_per_token
        ahead = ahead_of(req.tier, s.outstanding_by_tier, s.outstanding_requests)
        if s.slots <= 0:  # the site does not say how many it runs: all the work ahead counts as queued
            orq = s.outstanding_requests
            queued = s.outstanding_tokens * ahead / orq if orq else s.outstanding_tokens
            return (queued + work) / s.capacity_tok_s + wan + prefill
        open_slots = min(s.slots, s.window) if s.window else s.slots
        waiting = max(0, s.outstanding_requests + 1 - open_slots)
        if waiting:  # every slot taken: it waits for one to free, behind its own tier and those above
            waiting = max(1, ahead + 1 - open_slots)
        per_request = s.outstanding_tokens / s.outstanding_requests if s.outstanding_requests else work
        return waiting * per_request / s.capacity_tok_s + wan + prefill

    def fill(s: SiteLoad) -> float:
        if s.window and s.outstanding_requests + 1 > s.window:
            return 1.0  # past what it has proven: as full as a full site, whatever its free slots
        return min(1.0, (s.outstanding_requests + 1) / s.slots) if s.slots > 0 else 0.0

    def score(s: SiteLoad) -> float:
        return delay(s) + FILL_PENALTY_S * fill(s)

    candidates = _candidates(sites, req)
    most = max((ctx.cached_tokens.get(s.site, 0) for s in candidates), default=0)
    if most >= MIN_HIT_TOKENS:
        # Of the sites holding the most of it, the one that would serve it best.
        holder = min((s for s in candidates if ctx.cached_tokens.get(s.site, 0) == most), key=score)
        balanced = fill(holder) <= min(fill(s) for s in candidates) + HIT_FILL_MARGIN
        if balanced and all(delay(holder) <= delay(s) for s in candidates):
            return RouteDecision(holder.site, holder.agent_address, delay(holder), "least_expected_delay")
    return _pick("least_expected_delay", [(score(s), s) for s in candidates], delay)


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


# The policy that routes by where prompts' prefixes are cached. Under any other (a baseline a
# benchmark compares with) the gateways send no prefix hashes, so the sites' agents balance by
# load alone too: the baseline is blind to caches at every level.
PREFIX_AWARE_POLICY = "least_expected_delay"

POLICIES: dict[str, Policy] = {
    "least_expected_delay": least_expected_delay,
    "round_robin": round_robin,
    "least_outstanding": least_outstanding,
    "static_weights": static_weights,
}
