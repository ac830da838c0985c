"""`least_expected_delay` by columns, for a scheduler with many sites: the ready sites' loads
kept as arrays a row at a time, and the same decision made with array operations instead of a
Python loop per site (a thousand sites' loop cost milliseconds a route: docs/BENCHMARKS.md, "The
control plane at scale"). Apart from core/policy.py so that only the scheduler loads numpy."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from core.policy import FILL_PENALTY_S, HIT_FILL_MARGIN, MIN_HIT_TOKENS, RouteContext, SiteLoad
from core.tiers import Tier, ahead_of
from core.wire import RouteDecision, RouteRequest
from core.work import expected_output_tokens


class SiteColumns:
    """The loads of core.policy as columns, a site per row, kept up to date a row at a time by whoever
    owns them (the scheduler's registry), so that `least_expected_delay_columns` weighs every
    site with array operations instead of a Python loop per site: with a thousand sites the loop
    costs milliseconds a route (docs/BENCHMARKS.md, "The control plane at scale"). Rows keep
    the order sites were first put in, as the loads' list does, so both break ties alike."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}
        self.loads: list[SiteLoad | None] = []  # by row; None: not routable now
        self.regions: list[str] = []
        self._region_of: dict[str, int] = {}
        self._wan: dict[str, np.ndarray] = {}  # per client region: the round trip to each region
        size = 16
        self.ready = np.zeros(size, dtype=bool)
        self.capacity = np.zeros(size)
        self.outstanding_tokens = np.zeros(size)
        self.outstanding_requests = np.zeros(size)
        self.slots = np.zeros(size)
        self.window = np.zeros(size)
        self.prefill = np.zeros(size)
        self.region = np.zeros(size, dtype=np.intp)
        # Per service tier (a column per Tier): the outstanding requests a request of it waits behind.
        self.ahead = np.zeros((size, len(Tier)))

    _COLUMNS = (
        "ready",
        "capacity",
        "outstanding_tokens",
        "outstanding_requests",
        "slots",
        "window",
        "prefill",
        "region",
        "ahead",
    )

    def __len__(self) -> int:
        return len(self.loads)

    def put(self, name: str, load: SiteLoad | None) -> None:
        """`name`'s load now (None: not routable)."""
        row = self.rows.get(name)
        if row is None:
            if load is None:
                return
            row = self.rows[name] = len(self.loads)
            self.loads.append(None)
            if row >= len(self.ready):
                for column in self._COLUMNS:
                    old = getattr(self, column)
                    setattr(self, column, np.concatenate([old, np.zeros_like(old)]))
        self.loads[row] = load
        if load is None:
            self.ready[row] = False
            return
        region = self._region_of.get(load.region)
        if region is None:
            region = self._region_of[load.region] = len(self.regions)
            self.regions.append(load.region)
            self._wan.clear()
        self.ready[row] = True
        self.capacity[row] = load.capacity_tok_s
        self.outstanding_tokens[row] = load.outstanding_tokens
        self.outstanding_requests[row] = load.outstanding_requests
        self.slots[row] = load.slots
        self.window[row] = load.window
        self.prefill[row] = load.prefill_s_per_token
        self.region[row] = region
        self.ahead[row] = [ahead_of(tier, load.outstanding_by_tier, load.outstanding_requests) for tier in Tier]

    def wan(self, client_region: str, rtt_s: Mapping[tuple[str, str], float]) -> np.ndarray | float:
        """Each row's round trip from `client_region` (0 where unknown, as the loop has it)."""
        if not client_region:
            return 0.0
        by_region = self._wan.get(client_region)
        if by_region is None:
            by_region = np.array([rtt_s.get((client_region, r), 0.0) for r in self.regions])
            self._wan[client_region] = by_region
        return by_region[self.region[: len(self.loads)]]


def least_expected_delay_columns(columns: SiteColumns, req: RouteRequest, ctx: RouteContext) -> RouteDecision | None:
    """`least_expected_delay`, the same decision to the bit, over `columns` (the property test
    in tests/test_policy_columns.py holds them to it): the same expressions in the same order,
    on float64 arrays instead of one site at a time."""
    n = len(columns)
    if n == 0:
        return None
    work = expected_output_tokens(req.max_tokens)
    cap, ot, orq = columns.capacity[:n], columns.outstanding_tokens[:n], columns.outstanding_requests[:n]
    slots, window, prefill_rate = columns.slots[:n], columns.window[:n], columns.prefill[:n]
    candidates = columns.ready[:n] & (cap > 0)
    for name in req.exclude_sites:
        row = columns.rows.get(name)
        if row is not None:
            candidates[row] = False
    if not candidates.any():
        return None
    cached = np.zeros(n)
    for name, tokens in ctx.cached_tokens.items():
        row = columns.rows.get(name)
        if row is not None:
            cached[row] = tokens
    with np.errstate(divide="ignore", invalid="ignore"):  # rows that are no candidates may divide by 0
        wan = columns.wan(req.client_region if req.tier is not Tier.FLEX else "", ctx.rtt_s)  # flex: any region
        prefill = np.maximum(0, req.prompt_tokens - cached) * prefill_rate
        ahead = columns.ahead[:n, req.tier]
        open_slots = np.where(window != 0, np.minimum(slots, window), slots)
        waiting = np.maximum(0, orq + 1 - open_slots)
        waiting = np.where(waiting > 0, np.maximum(1, ahead + 1 - open_slots), 0)
        per_request = np.where(orq != 0, ot / orq, work)
        unslotted = (np.where(orq != 0, ot * ahead / orq, ot) + work) / cap
        queued = np.where(slots <= 0, unslotted, waiting * per_request / cap)
        delay = queued + wan + prefill
        fill = np.where(
            (window != 0) & (orq + 1 > window), 1.0, np.where(slots > 0, np.minimum(1.0, (orq + 1) / slots), 0.0)
        )
        score = delay + FILL_PENALTY_S * fill
    most = cached[candidates].max()
    if most >= MIN_HIT_TOKENS:
        holder = int(np.where(candidates & (cached == most), score, np.inf).argmin())
        balanced = fill[holder] <= fill[candidates].min() + HIT_FILL_MARGIN
        if balanced and bool((delay[holder] <= delay[candidates]).all()):
            return _decided(columns, holder, delay)
    return _decided(columns, int(np.where(candidates, score, np.inf).argmin()), delay)


def _decided(columns: SiteColumns, row: int, delay: np.ndarray) -> RouteDecision:
    load = columns.loads[row]
    assert load is not None
    return RouteDecision(load.site, load.agent_address, float(delay[row]), "least_expected_delay")
