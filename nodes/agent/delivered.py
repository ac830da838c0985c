"""What a site delivers: the output tokens its agent relayed, per second, over recent seconds.

The schedulers learn a site's capacity and grow a new site's share from this, measured where
the tokens pass, rather than from the workers' `gen_throughput` gauge: SGLang renews that only
every 40 decode steps (`--decode-log-interval`), ~4.6 s of a full MI355X batch, so it is
seconds stale and steps like a staircase on the schedulers' 5-s time constants.
"""

from __future__ import annotations

import time
from collections import deque

WINDOW_S = 5.0


class DeliveredRate:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.total = 0  # output tokens relayed since the agent started
        self.last_rate = 0.0  # what `sample` last said
        self._marks: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])

    def add(self, tokens: int) -> None:
        self.total += tokens

    def sample(self) -> float:
        """Tokens/s over the last `window_s` (over all the time there is, before that much has
        passed). Called at a steady tick, which keeps the marks the window is measured from."""
        now, marks = time.monotonic(), self._marks
        marks.append((now, self.total))
        while len(marks) > 2 and now - marks[1][0] >= self.window_s:
            marks.popleft()
        t0, n0 = marks[0]
        self.last_rate = (self.total - n0) / (now - t0) if now > t0 else 0.0
        return self.last_rate
