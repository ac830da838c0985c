"""`fedctl site add --emulate`: a new region joins a running `fedctl up`, is routed to, and stops
with it; a duplicate name is refused with the reason."""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter
from pathlib import Path

import openai
import pytest

from federation.processes import start_python
from tests.conftest import SITES, fedctl
from tests.test_federation import MODEL, _config

NEWCOMER = ["--name", "eu-mi355x", "--region", "us-west-2", "--gpu", "mi355x", "--gpus", "2", "--emulate"]


@pytest.mark.timeout(240)
async def test_a_site_added_to_a_running_federation_serves_and_stops_with_it(tmp_path: Path) -> None:
    """`fedctl site add` returns once the new site is ready at the schedulers; requests then
    reach it; the same name again is refused; Ctrl-C on `fedctl up` stops its agent too."""
    path, _ = _config(tmp_path, SITES)
    up = start_python("fedctl up", "federation.cli", ["up", "--config", str(path)], timeout_s=90)
    try:
        added = fedctl("site", "add", *NEWCOMER, "--config", str(path))
        assert added.returncode == 0, added.stderr[-2000:]
        agent = added.stdout.split("agent at ")[1].split(";")[0]
        status = json.loads(fedctl("status", "--json", "--config", str(path)).stdout)
        assert {s["name"]: s["state"] for s in status["sites"]}["eu-mi355x"] == "ready"

        again = fedctl("site", "add", *NEWCOMER, "--config", str(path))
        assert again.returncode == 2 and "already in this federation" in again.stderr

        async with openai.AsyncOpenAI(base_url=up.ready["endpoint"], api_key="unused", max_retries=0) as client:

            async def one(i: int) -> str:
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"q {i}"}], max_tokens=50
                )
                return raw.headers["x-federation-site"]

            sites = Counter(await asyncio.gather(*(one(i) for i in range(60))))
        assert sites["eu-mi355x"] > 0, sites
    finally:
        assert up.stop(30) == 0
    host, port = agent.rsplit(":", 1)
    with socket.socket() as sock:  # the added site's agent stopped with the federation
        assert sock.connect_ex((host, int(port))) != 0


def test_site_add_without_a_running_federation_says_so(tmp_path: Path) -> None:
    """No `fedctl up` for this config: a clear error, exit 1."""
    path, _ = _config(tmp_path, SITES)
    proc = fedctl("site", "add", *NEWCOMER, "--config", str(path))
    assert proc.returncode == 1 and "start the federation with `fedctl up` first" in proc.stderr
