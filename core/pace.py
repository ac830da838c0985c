"""A site's pace, read from its own report: how long its decode step takes, and whether the step
in progress has overrun that.

Shared by the agent's reporter (a report goes at once when a step begins to overrun) and the
scheduler's capacity estimator (the site's capacity is cut while it lasts). A slow step's tokens
come only at its end, so the rate a site delivers shows a brownout seconds late; the age of the
step in progress shows it while it happens.
"""

from __future__ import annotations

from core.wire import SiteReport

# Overrun: the step in progress has run this many times the site's recent step, an average that
# already holds its usual prefill (a step carrying a whole prefill chunk, a wave of arrivals,
# can reach it: the cut then lasts that step; a brownout's steps run 4x) ...
OVERRUN_FACTOR = 1.75
# ... and this much longer at least: the agent hears a step up to its loop's lag late (at high
# emulated speeds a step is a millisecond, and that lag alone would read as overruns).
OVERRUN_MIN_S = 0.2


def recent_step_s(report: SiteReport) -> float:
    """The site's recent step: its decode batch over the output tokens/s it delivered lately (a
    step gives each running request one token). 0 when either is unknown."""
    if report.running_requests <= 0 or report.delivered_tok_s <= 0:
        return 0.0
    return report.running_requests / report.delivered_tok_s


def overrun_factor(report: SiteReport) -> float:
    """While the step in progress overruns the site's recent pace: that step / the step so far
    (at most the share of its pace the site runs at now). 1 otherwise, or when nothing says."""
    step_s, age_s = recent_step_s(report), report.step_age_s
    if step_s <= 0 or age_s <= 0:
        return 1.0
    if age_s >= OVERRUN_FACTOR * step_s and age_s >= step_s + OVERRUN_MIN_S:
        return step_s / age_s
    return 1.0
