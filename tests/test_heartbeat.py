"""Site heartbeats leave from the agent's reporter process, so an agent stopped for a moment
(a long collection of its heap, a loop busy in compiled code) is still up, and only an agent
stopped for longer than the stall limit is down."""

from __future__ import annotations

import signal
import threading
import time

import psutil
import pytest

from core import wire
from core.settings import AgentTimings
from federation import admin
from federation.drills.faults import poll_until

SITE = "kr-mi300x"
HEARTBEAT_S = 1.0  # the schedulers' rule: one report-less second and a site is down


def _status(addresses, operator) -> wire.SiteStatus:
    state, _ = admin.replicas_state(addresses, operator)
    assert state is not None
    return next(s.status for s in state.sites if s.name == SITE)


@pytest.mark.timeout(120)
def test_a_paused_agent_stays_up_and_a_hung_one_goes_down(make_federation) -> None:
    """SIGSTOP on the agent's process: after 2 s (twice the heartbeat) the site is still ready,
    reported by its reporter process; past the stall limit the reports stop and it is down;
    SIGCONT, and it is ready again."""
    fed, _ = make_federation()
    addresses = list(fed.config.scheduler_addresses)
    agent = fed.child(f"agent {SITE}").proc
    assert _status(addresses, fed.operator) is wire.SiteStatus.READY
    agent.send_signal(signal.SIGSTOP)
    try:
        time.sleep(2 * HEARTBEAT_S)
        assert _status(addresses, fed.operator) is wire.SiteStatus.READY
        down_after_s = poll_until(
            lambda: _status(addresses, fed.operator) is wire.SiteStatus.DOWN, AgentTimings().loop_stall_limit_s + 5
        )
        assert down_after_s is not None
        assert 2 * HEARTBEAT_S + down_after_s >= AgentTimings().loop_stall_limit_s
    finally:
        agent.send_signal(signal.SIGCONT)
    assert poll_until(lambda: _status(addresses, fed.operator) is wire.SiteStatus.READY, 5.0) is not None


@pytest.mark.timeout(120)
def test_a_scheduler_that_always_lags_still_marks_a_silent_site_down(make_federation) -> None:
    """The scheduler skips expiry checks that come late (its loop was stalled, reports may be
    unread), but not forever: stalled again and again, it still marks a silent site down."""
    fed, _ = make_federation()
    addresses = list(fed.config.scheduler_addresses)
    scheduler = fed.child("scheduler 0").proc
    silent = [
        p for p in psutil.Process(fed.child(f"agent {SITE}").pid).children() if "spawn_main" in " ".join(p.cmdline())
    ]
    stop = threading.Event()

    def lag_forever() -> None:  # every expiry check comes ~0.4 s late
        while not stop.is_set():
            scheduler.send_signal(signal.SIGSTOP)
            time.sleep(0.5)
            scheduler.send_signal(signal.SIGCONT)
            time.sleep(0.02)

    lagging = threading.Thread(target=lag_forever, daemon=True)
    lagging.start()
    for p in silent:
        p.suspend()  # its reporter: the site's reports stop, its connections stay open
    try:
        down_after_s = poll_until(lambda: _status(addresses, fed.operator) is wire.SiteStatus.DOWN, 30.0)
    finally:
        stop.set()
        lagging.join()
        scheduler.send_signal(signal.SIGCONT)
        for p in silent:
            p.resume()
    assert down_after_s is not None
