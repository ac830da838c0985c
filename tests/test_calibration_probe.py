"""A joining site's calibration probe: the scheduler's estimate starts from how fast the
site's workers really decode, not from the GPUs it declares."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from core import wire
from core.mtls import INSECURE
from core.processes import free_port_block, spawn_python, start_python
from federation.admin import fetch_state
from federation.drills.faults import poll_until
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


@pytest.mark.timeout(90)
def test_an_agent_stalled_in_the_middle_of_its_probe_is_not_misread(tmp_path: Path) -> None:
    """The agent's process is stopped for 3 s while its probe's requests decode: their tokens
    are read late and together (as a collection or a burst of other work would leave them; once
    that read 450 M tok/s). Those samples are left out and the probe runs again, so the site
    starts within 2 x of its prior (its GPUs are what it declares), and the agent says it saw
    the stall."""
    scheduler_port, agent_port = free_port_block(1), free_port_block(1)
    children = [start_python("scheduler", "scheduler", ["--insecure", "--port", str(scheduler_port)])]
    log = (tmp_path / "agent.log").open("w")
    try:
        emulator = launch(["--profile", "mi300x", "--workers", "2", "--speed", str(SPEED)])
        children.append(emulator)
        args = ["--insecure", "--site", "s", "--region", "r", "--gpu", "mi300x", "--gpus", "2"]
        args += ["--port", str(agent_port), "--scheduler", f"127.0.0.1:{scheduler_port}"]
        for url in emulator.urls:
            args += ["--worker-url", url]
        agent = spawn_python("agent", "nodes.agent", args, log=log)  # it is ready once probed and reporting
        children.append(agent)
        assert poll_until(lambda: _decoding(emulator.urls[0]), 30.0, every_s=0.01) is not None
        os.kill(agent.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(agent.pid, signal.SIGCONT)
        assert poll_until(lambda: _ready(scheduler_port), 30.0) is not None
        site = fetch_state(f"127.0.0.1:{scheduler_port}", INSECURE).sites[0]
    finally:
        for child in reversed(children):
            child.stop()
        log.close()
    prior = prior_capacity_tok_s("mi300x", 2) * SPEED
    assert site.capacity_evidence == "probe" and 0.5 * prior < site.capacity_tok_s < 2 * prior, site.capacity_tok_s
    assert "calibrate.loop_stalled" in (tmp_path / "agent.log").read_text()


def _decoding(url: str) -> bool:
    """The worker is decoding some of the probe's requests."""
    with urllib.request.urlopen(url + "/_emulator/state", timeout=5) as resp:
        return json.loads(resp.read())["engine"]["running"] > 0


def _ready(scheduler_port: int) -> bool:
    sites = fetch_state(f"127.0.0.1:{scheduler_port}", INSECURE).sites
    return bool(sites) and sites[0].status is wire.SiteStatus.READY
