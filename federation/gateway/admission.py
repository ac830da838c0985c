"""Latency mode: a request with a TTFT budget is sent only to a site that can meet it.

Throughput mode (no budget) sends every request at once to the best site: queues at the
sites are how an Offline run keeps every GPU busy. With a budget (the gateway's
`--ttft-budget-ms`, or a request's `X-TTFT-Budget-Ms`), the gateway first asks the
scheduler, without committing, how long the best site would take to start it. If that is
over what is left of the budget, the request is held here, in one bounded queue, and gets
429 with Retry-After when its budget is spent or the queue is full. A site is never handed
work it would make everyone miss their SLO for.

Held requests do not ask the scheduler again: each time the watched federation state changes
(every ~0.1 s), the queue's head is weighed locally, with the scheduler's own policy, against
that state plus the requests released since (`Schedulers.estimate`); heads that fit now leave
for a real route, in order (a head that still does not fit holds those behind it until its
budget is spent: weighing every held request at every state would cost what polling did).
The queue is served by service tier (core/tiers.py), priority first; a full queue refuses the
newest request of a lower tier than the one arriving (429, Retry-After) before that one.
10,000 held requests cost the scheduler nothing while they wait (they used to ask it 20 times
a second each).

In throughput mode a tier may have a patience (`--patience-s TIER=S`; flex's by default): the
longest a request of it may expect to wait for its first token. The route carries it
(`max_delay_s`); a decision that expects longer is not charged at the site, and the request is
refused with 429 and Retry-After, before it holds anything anywhere. The expected delay counts
only the work of the request's own tier and the tiers above (core/policy.py), so flex is refused
first, then default, and priority only when priority work alone fills every site that long.
Only a request's first route has a patience: a retry or a resume is never refused for its tier.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from core import supervise, wire
from core.errors import BadRequest, TierBusy, TooBusy
from core.tiers import PATIENCE_S, Tier, TieredQueue
from federation.gateway.schedulers import Schedulers

BUDGET_HEADER = "X-TTFT-Budget-Ms"
MAX_HELD = 10_000  # requests held at once by default (--max-held); more are refused with 429


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


@dataclass(slots=True)
class _Held:
    probe: wire.RouteRequest  # the request, as a dry run
    deadline: float  # monotonic: when its budget is spent
    released: asyncio.Future[None]


class Admission:
    def __init__(self, schedulers: Schedulers, max_held: int, patience_s: Mapping[Tier, float] = PATIENCE_S) -> None:
        # with no new state (a scheduler lost), the queue's head is weighed this often
        self._check_s = schedulers.timings.hold_check_s
        self.schedulers = schedulers
        self.max_held = max_held
        self.patience_s = patience_s  # throughput mode: by tier, the longest wait expected (absent: no bound)
        self._queue: TieredQueue[_Held] = TieredQueue()  # served by service tier (core/tiers.py)
        self._pump: asyncio.Task[None] | None = None
        self._soonest_s = 0.0  # the head's expected delay when last weighed (for Retry-After)

    @property
    def held(self) -> int:
        """Requests waiting here for a site that can meet their budget."""
        return len(self._queue)

    def held_by_tier(self) -> dict[str, int]:
        return self._queue.counts()

    async def route(self, req: wire.RouteRequest, budget: float | None) -> wire.RouteDecision:
        if budget is None:
            return await self._route_within_patience(req)
        deadline = time.monotonic() + budget
        probe = dataclasses.replace(req, dry_run=True)
        best = await self.schedulers.route(probe)
        left = deadline - time.monotonic()
        if best.expected_delay_s <= left:  # even past held ones: theirs may be a far region's, or a tight budget
            return await self.schedulers.route(req)
        retry_after = max(1, math.ceil(best.expected_delay_s))
        if left <= self._check_s / 2:
            raise TooBusy(
                f"No site can start this request within its TTFT budget ({budget * 1000:.0f} ms): "
                f"the soonest is {best.expected_delay_s * 1000:.0f} ms away.",
                retry_after_s=retry_after,
            )
        if len(self._queue) >= self.max_held:
            full = TooBusy(
                f"Every site is past its TTFT budget and {self.max_held} requests are already waiting.",
                retry_after_s=retry_after,
            )
            given_up = self._queue.pop_newest_below(req.tier)  # a lower tier's is refused before this one
            if given_up is None:
                raise full
            if not given_up.released.done():
                given_up.released.set_exception(full)
        held = _Held(probe, deadline, asyncio.get_running_loop().create_future())
        self._queue.append(req.tier, held)
        if self._pump is None or self._pump.done():
            self._pump = supervise.restarting("gateway.admission", self._release_forever)
        try:
            async with asyncio.timeout(left):
                await held.released
        except TimeoutError:
            raise TooBusy(
                f"No site could start this request within its TTFT budget ({budget * 1000:.0f} ms): "
                f"the soonest was {self._soonest_s * 1000:.0f} ms away.",
                retry_after_s=max(1, math.ceil(self._soonest_s)),
            ) from None
        finally:
            if not held.released.done():
                held.released.cancel()  # left the queue: the pump drops it when it reaches it
        return await self.schedulers.route(req)

    async def _route_within_patience(self, req: wire.RouteRequest) -> wire.RouteDecision:
        """Throughput mode: the best site, unless it would start the request later than its tier waits."""
        patience = self.patience_s.get(req.tier, 0.0)
        if patience <= 0:
            return await self.schedulers.route(req)
        req = dataclasses.replace(req, max_delay_s=patience)
        decision = await self.schedulers.route(req)
        if req.over_patience(decision):  # not charged at the site: the scheduler saw the same
            raise TierBusy(
                f"Every site is busy with work that goes before {req.tier.label} requests: the soonest would start "
                f"this one {decision.expected_delay_s:.0f} s from now, and {req.tier.label} requests wait at most "
                f"{patience:g} s here.",
                retry_after_s=max(1, math.ceil(decision.expected_delay_s - patience)),
            )
        return decision

    async def _release_forever(self) -> None:
        """While requests are held: at each new state, release the heads that fit, in order."""
        while self._queue:
            await self.schedulers.state_changed(self._check_s)
            now = time.monotonic()
            while (head := self._queue.head()) is not None:
                if head.released.done():  # its budget ran out, or its client left
                    self._queue.popleft()
                    continue
                best = self.schedulers.estimate(head.probe)
                self._soonest_s = best.expected_delay_s if best else self._soonest_s
                if best is None or best.expected_delay_s > head.deadline - now:
                    break
                self._queue.popleft()
                self.schedulers.count_routed(best.site, head.probe)  # the next head is weighed with it
                head.released.set_result(None)
