"""Waiters keyed by the global step they wait for, released in step order.

Why buckets: with an event per decode step, the ~1,000 streams of one GPU nearly all
wait for the same next step, so a list per step makes adding and releasing a waiter
O(1); a heap of the distinct steps (a handful at a time) gives the engine the earliest
one, the only step it keeps a timer for.
"""

from __future__ import annotations

import heapq
from typing import Generic, TypeVar

T = TypeVar("T")


class StepWakeups(Generic[T]):
    def __init__(self) -> None:
        self._buckets: dict[int, list[T]] = {}
        self._steps: list[int] = []  # heap of the keys of `_buckets`

    def add(self, step: int, waiter: T) -> None:
        bucket = self._buckets.get(step)
        if bucket is None:
            self._buckets[step] = [waiter]
            heapq.heappush(self._steps, step)
        else:
            bucket.append(waiter)

    def first(self) -> int | None:
        """The earliest step anyone waits for."""
        return self._steps[0] if self._steps else None

    def pop_due(self, step: int) -> list[T]:
        """Remove and return every waiter for a step up to `step`, earliest step first."""
        due: list[T] = []
        while self._steps and self._steps[0] <= step:
            due += self._buckets.pop(heapq.heappop(self._steps))
        return due
