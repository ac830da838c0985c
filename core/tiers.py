"""Service tiers (issue #46): which requests wait for which, when there is not room for all.

OpenAI's `service_tier` is the contract: `priority` (interactive work, served first), `default`,
`flex` (batch work: served from spare capacity, may wait, may be refused with 429 and
Retry-After, never failed mid-stream for its tier), or `auto` (the key's default tier). A key
carries a default tier and a ceiling: a key may ask for no tier above its ceiling (refused with
403 naming the field); a gateway without keys allows every tier. The tier used is said back in
each response's `service_tier`.

A tier orders every place a request waits: the gateway's hold queue, the site's admission queue
(nodes/agent/pool.py), and the worker's own waiting queue through SGLang's request priority.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterator, Mapping, Sequence
from typing import Generic, Literal, TypeVar, cast

from core.errors import BadRequest, NotAllowed

TierName = Literal["priority", "default", "flex"]
AUTO = "auto"


class Tier(enum.IntEnum):
    """Lower is served sooner: a queue sorted by tier serves priority first, flex last."""

    PRIORITY = 0
    DEFAULT = 1
    FLEX = 2

    @property
    def label(self) -> TierName:
        """Its name in OpenAI's `service_tier`."""
        return cast(TierName, self.name.lower())

    @classmethod
    def named(cls, name: str) -> Tier:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown service tier {name!r}: one of priority, default, flex") from None


def resolve(asked: str | None, default: Tier = Tier.DEFAULT, ceiling: Tier = Tier.PRIORITY) -> Tier:
    """The tier a request is served in: `service_tier` as asked (absent or `auto`: `default`, the
    key's), if the key's `ceiling` allows it. Raises BadRequest for a name that is no tier,
    NotAllowed for one above the ceiling."""
    if asked is None or asked == AUTO:
        return default
    try:
        tier = Tier.named(asked)
    except ValueError as exc:
        raise BadRequest(f"`service_tier`: {exc}, or auto", param="service_tier") from None
    if tier < ceiling:
        raise NotAllowed(
            f"This API key may not ask for service_tier {tier.label!r}: its highest tier is {ceiling.label!r}.",
            param="service_tier",
        )
    return tier


# Throughput mode's patience by default (the gateway's --patience-s TIER=S): flex work waits at
# most this long for a site, else 429 with Retry-After (batch work, which can come back);
# default and priority queue as deep as the work sent (an MLPerf Offline run sends it all at
# once). Seconds of expected delay before the first token, by the sites' clock.
PATIENCE_S: Mapping[Tier, float] = {Tier.FLEX: 60.0}


def ahead_of(tier: Tier, by_tier: Sequence[int], total: int) -> int:
    """Of the `total` requests outstanding at a site (`by_tier`: how many of each tier, in Tier's
    order), those a request of `tier` waits behind there: its own tier's and the more urgent
    ones, the site's queues being served by tier. All of them when the site does not say its
    tiers (an empty `by_tier`)."""
    return sum(by_tier[: tier + 1]) if by_tier else total


# SGLang's request priority for each tier (0.5.23, --enable-priority-scheduling): larger is
# served first, unless --schedule-low-priority-values-first. A waiting request preempts a
# running one only when their priorities differ by more than
# --priority-scheduling-preemption-threshold (10 by default, strictly): so priority work
# preempts flex work on a full batch (which SGLang retracts and later recomputes, its tokens
# kept: never failed), and default work preempts nothing.
SGLANG_PRIORITY = {Tier.PRIORITY: 20, Tier.DEFAULT: 10, Tier.FLEX: 0}


def sglang_priority(tier: Tier, low_values_first: bool) -> int:
    value = SGLANG_PRIORITY[tier]
    return -value if low_values_first else value


def from_sglang_priority(priority: int) -> Tier:
    """The tier a native /generate request's SGLang `priority` asks for (larger first, as
    SGLang's default): priority from 20, flex at 0 or below, default between."""
    if priority >= SGLANG_PRIORITY[Tier.PRIORITY]:
        return Tier.PRIORITY
    return Tier.FLEX if priority <= SGLANG_PRIORITY[Tier.FLEX] else Tier.DEFAULT


T = TypeVar("T")


class TieredQueue(Generic[T]):
    """First in, first out within a tier; a tier's items all before the next tier's."""

    def __init__(self) -> None:
        self._queues: tuple[collections.deque[T], ...] = tuple(collections.deque() for _ in Tier)

    def append(self, tier: Tier, item: T) -> None:
        self._queues[tier].append(item)

    def remove(self, tier: Tier, item: T) -> bool:
        """`item` taken out of `tier`'s queue; False if it was not there."""
        try:
            self._queues[tier].remove(item)
        except ValueError:
            return False
        return True

    def head(self) -> T | None:
        """The item served next (None: empty)."""
        return next((q[0] for q in self._queues if q), None)

    def popleft(self) -> T:
        """The item served next, taken out (IndexError: empty)."""
        for queue in self._queues:
            if queue:
                return queue.popleft()
        raise IndexError("pop from an empty TieredQueue")

    def pop_newest_below(self, tier: Tier) -> T | None:
        """The newest item of the lowest tier below `tier`, taken out (None: none below it): what
        a full queue gives up for an item of `tier`."""
        for lower in reversed(Tier):
            if lower <= tier:
                return None
            if self._queues[lower]:
                return self._queues[lower].pop()
        return None

    def waiting(self, tier: Tier) -> int:
        return len(self._queues[tier])

    def counts(self) -> dict[str, int]:
        """How many wait in each tier, by the tier's name (for metrics)."""
        return {tier.label: len(self._queues[tier]) for tier in Tier}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    def __bool__(self) -> bool:
        return any(self._queues)

    def __iter__(self) -> Iterator[T]:
        """In the order they would be served."""
        for queue in self._queues:
            yield from queue
