"""Latency mode: a request with a TTFT budget is sent only to a site that can meet it.

Throughput mode (no budget) sends every request at once to the best site: queues at the
sites are how an Offline run keeps every GPU busy. With a budget (the gateway's
`--ttft-budget-ms`, or a request's `X-TTFT-Budget-Ms`), the gateway first asks the
scheduler, without committing, how long the best site would take to start it. If that is
over what is left of the budget, the request is held here, in one bounded queue, and asks
again every HOLD_POLL_S; it leaves for a site as soon as one can meet what is left, or gets
429 with Retry-After when the budget is spent or the queue is full. A site is never handed
work it would make everyone miss their SLO for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from federation import wire
from federation.errors import BadRequest, TooBusy
from federation.gateway.schedulers import Schedulers

HOLD_POLL_S = 0.05  # how often a held request asks again: a slot frees every few ms at MLPerf load
BUDGET_HEADER = "X-TTFT-Budget-Ms"


def budget_s(header: str | None, default_ms: float) -> float | None:
    """The request's TTFT budget in seconds (its header, else the gateway's), None: throughput mode."""
    if header is None:
        return default_ms / 1000 if default_ms > 0 else None
    try:
        ms = float(header)
    except ValueError:
        raise BadRequest(f"{BUDGET_HEADER} must be a number of milliseconds, got {header!r}") from None
    if not math.isfinite(ms) or ms < 0:
        raise BadRequest(f"{BUDGET_HEADER} must be a number of milliseconds >= 0, got {header!r}")
    return ms / 1000 if ms > 0 else None


class Admission:
    def __init__(self, schedulers: Schedulers, max_held: int) -> None:
        self.schedulers = schedulers
        self.max_held = max_held
        self.held = 0  # requests waiting here for a site that can meet their budget

    async def route(self, req: wire.RouteRequest, budget: float | None) -> wire.RouteDecision:
        if budget is None:
            return await self.schedulers.route(req)
        deadline = time.monotonic() + budget
        probe = dataclasses.replace(req, dry_run=True)
        holding = False
        try:
            while True:
                best = await self.schedulers.route(probe)
                left = deadline - time.monotonic()
                if best.expected_delay_s <= left:
                    return await self.schedulers.route(req)
                retry_after = max(1, math.ceil(best.expected_delay_s))
                if left <= HOLD_POLL_S:
                    raise TooBusy(
                        f"No site can start this request within its TTFT budget ({budget * 1000:.0f} ms): "
                        f"the soonest is {best.expected_delay_s * 1000:.0f} ms away.",
                        retry_after_s=retry_after,
                    )
                if not holding:
                    if self.held >= self.max_held:
                        raise TooBusy(
                            f"Every site is past its TTFT budget and {self.max_held} requests are already waiting.",
                            retry_after_s=retry_after,
                        )
                    self.held, holding = self.held + 1, True
                await asyncio.sleep(HOLD_POLL_S)
        finally:
            if holding:
                self.held -= 1
