"""A joining site's calibration probe: the scheduler's estimate starts from how fast the
site's workers really decode, not from the GPUs it declares."""

from __future__ import annotations

import time

import pytest

from core import wire
from core.mtls import INSECURE
from core.processes import free_port_block, start_python
from federation.admin import fetch_state
from nodes.emulator.launch import launch
from scheduler.capacity import prior_capacity_tok_s

SPEED = 1.0  # real time: the probe lasts ~2 s, long beside scheduling noise on a busy machine


@pytest.mark.timeout(90)
def test_a_site_declared_mi355x_with_mi300x_workers_starts_near_mi300x_capacity() -> None:
    """Two workers that run like MI300X, declared as MI355X: before any traffic the site's
    capacity is near two MI300X's (at the emulated speed), less than half the declared."""
    scheduler_port, agent_port = free_port_block(1), free_port_block(1)
    children = [start_python("scheduler", "scheduler", ["--insecure", "--port", str(scheduler_port)])]
    try:
        emulator = launch(["--profile", "mi300x", "--workers", "2", "--speed", str(SPEED)])
        children.append(emulator)
        args = [
            "--insecure",
            "--site",
            "s",
            "--region",
            "r",
            "--gpu",
            "mi355x",
            "--gpus",
            "2",
            "--port",
            str(agent_port),
        ]
        args += ["--scheduler", f"127.0.0.1:{scheduler_port}"]
        for url in emulator.urls:
            args += ["--worker-url", url]
        children.append(start_python("agent", "nodes.agent", args))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sites = fetch_state(f"127.0.0.1:{scheduler_port}", INSECURE).sites
            if sites and sites[0].status is wire.SiteStatus.READY:
                break
            time.sleep(0.1)
        site = sites[0]
    finally:
        for child in reversed(children):
            child.stop()
    assert site.capacity_evidence == "probe"
    declared, real = prior_capacity_tok_s("mi355x", 2) * SPEED, prior_capacity_tok_s("mi300x", 2) * SPEED
    assert site.capacity_tok_s < 0.5 * declared
    assert abs(site.capacity_tok_s / real - 1) < 0.35, (site.capacity_tok_s, real)
