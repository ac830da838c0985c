"""Slow start: a site that joins (or comes back) earns its slots by decoding what it is given.

An empty site with free slots is where every new request would start soonest, so without a limit
it takes all of them at once, prefills them all before decoding any (SGLang runs prefill first)
and delivers nothing for seconds while each of them waits for its first token (as the healed
site did in the partition drill: docs/BENCHMARKS.md, "Failover drills"). So routing may fill
only a window of a new site's slots. The window starts at what the calibration probe proved (its
batch on every worker), or at what the site already runs, and doubles each time the site shows
it decodes at least half of it: its generation rate at least half the window's share of its
measured capacity. Growth follows what the site proves, not a timer; once the window reaches the
site's slots, slow start is over.
"""

from __future__ import annotations

from dataclasses import dataclass

UNPROBED_BATCH_PER_WORKER = 16  # a site that ran no probe starts as if it had proven this
GROWTH = 2  # TCP's: double per proof
PROVEN_SHARE = 0.5  # decoding at this share of the window's capacity counts as proof


@dataclass(slots=True)
class SlowStart:
    window: int  # requests routing may fill at the site; 0: no limit (slow start over)

    @classmethod
    def begin(cls, probe_batch_per_worker: float, workers: int) -> SlowStart:
        per_worker = probe_batch_per_worker or UNPROBED_BATCH_PER_WORKER
        return cls(max(1, round(per_worker * workers)))

    def observe(self, running: int, gen_tok_s: float, capacity_tok_s: float, site_slots: int) -> None:
        """One report: what the site runs, what it generates, what it is measured to sustain."""
        if not self.window or site_slots <= 0 or capacity_tok_s <= 0:
            self.window = 0
            return
        self.window = max(self.window, running)  # what it already runs, it has proven it holds
        if gen_tok_s >= PROVEN_SHARE * self.window / site_slots * capacity_tok_s:
            self.window *= GROWTH
        if self.window >= site_slots:
            self.window = 0
