"""`fedctl site add --emulate`: a new region joins a running `fedctl up`, is routed to, and is
drained and removed (its processes stopped) while the rest serve on; a duplicate name is refused
with the reason; a site still there stops with the federation."""

from __future__ import annotations

import asyncio
import json
import queue
import socket
from collections import Counter
from pathlib import Path

import openai
import pytest

from core.processes import Child, start_python
from federation.cli import _site_controls
from tests.conftest import SITES, fedctl
from tests.test_federation import MODEL, _config

NEWCOMER = ["--name", "eu-mi355x", "--region", "us-west-2", "--gpu", "mi355x", "--gpus", "2", "--emulate"]


def _up(tmp_path: Path) -> tuple[Path, Child]:
    """A running `fedctl up` of the two-site test federation, one GPU a site (it launches a
    process per GPU: what is added, routed to and stopped here is the newcomer), and its config."""
    path, _ = _config(tmp_path, SITES, gpus=1)
    return path, start_python("fedctl up", "federation.cli", ["up", "--config", str(path)], timeout_s=90)


def _add_newcomer(path: Path) -> str:
    """`fedctl site add` of NEWCOMER, which must succeed; its agent's address."""
    added = fedctl("site", "add", *NEWCOMER, "--config", str(path))
    assert added.returncode == 0, added.stderr[-2000:]
    return added.stdout.split("agent at ")[1].split(";")[0]


def _closed(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as sock:
        return sock.connect_ex((host, int(port))) != 0


async def _sites_of(endpoint: str, requests: int) -> Counter:
    async with openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0) as client:

        async def one(i: int) -> str:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"q {i}"}], max_tokens=50
            )
            return raw.headers["x-federation-site"]

        return Counter(await asyncio.gather(*(one(i) for i in range(requests))))


@pytest.mark.timeout(240)
async def test_a_site_added_to_a_running_federation_serves_and_is_removed(tmp_path: Path) -> None:
    """`fedctl site add` returns once the new site is ready at the schedulers; requests then
    reach it; the same name again is refused; drained and removed, its agent stops and the
    others serve on."""
    path, up = _up(tmp_path)
    try:
        agent = _add_newcomer(path)
        status = json.loads(fedctl("status", "--json", "--config", str(path)).stdout)
        assert {s["name"]: s["state"] for s in status["sites"]}["eu-mi355x"] == "ready"

        again = fedctl("site", "add", *NEWCOMER, "--config", str(path))
        assert again.returncode == 2 and "already in this federation" in again.stderr

        sites = await _sites_of(up.ready["endpoint"], 60)
        assert sites["eu-mi355x"] > 0, sites

        assert fedctl("site", "drain", "eu-mi355x", "--config", str(path)).returncode == 0
        removed = fedctl("site", "remove", "eu-mi355x", "--config", str(path))
        assert removed.returncode == 0 and "stopped agent eu-mi355x" in removed.stdout, removed.stdout
        assert _closed(agent)
        status = json.loads(fedctl("status", "--json", "--config", str(path)).stdout)
        assert "eu-mi355x" not in {s["name"] for s in status["sites"]}
        assert set(await _sites_of(up.ready["endpoint"], 10)) <= {"kr-mi300x", "us-mi355x"}
    finally:
        assert up.stop(30) == 0


@pytest.mark.timeout(240)
def test_a_site_added_stops_with_the_federation(tmp_path: Path) -> None:
    """Ctrl-C on `fedctl up` stops the added site's agent too."""
    path, up = _up(tmp_path)
    try:
        agent = _add_newcomer(path)
    finally:
        assert up.stop(30) == 0
    assert _closed(agent)


def test_site_add_without_a_running_federation_says_so(tmp_path: Path) -> None:
    """No `fedctl up` for this config: a clear error, exit 1."""
    path, _ = _config(tmp_path, SITES)
    proc = fedctl("site", "add", *NEWCOMER, "--config", str(path))
    assert proc.returncode == 1 and "start the federation with `fedctl up` first" in proc.stderr


@pytest.mark.parametrize(
    ("site", "said"),
    [
        ({"name": "eu", "region": "eu-central-1", "gpu": "h100", "gpus": 8}, "the site: gpu: Input should be"),
        ({"name": "eu", "region": "eu-central-1", "gpu": "mi355x", "gpus": 0}, "the site: gpus: Input should be"),
        ({"name": "eu", "region": "eu-central-1", "gpu": "mi355x", "gpus": "8"}, "the site: gpus"),
        ({"name": "eu", "gpu": "mi355x", "gpus": 8}, "'region' is missing"),
    ],
)
def test_a_site_to_add_is_checked_as_the_config_checks_a_site(site: dict, said: str) -> None:
    """What `fedctl site add` sends the running `fedctl up` is a site of the config's one schema
    (core.config.SiteConfig): a bad one is refused with the field named, and nothing starts."""
    handle = _site_controls(None, queue.Queue())  # type: ignore[arg-type]  # nothing may start
    reply = handle({"command": "add_site", "site": site})
    assert said in reply["error"], reply
