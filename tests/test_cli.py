"""`python -m nodes.emulator`: ready line, one port per GPU, clean stop, clear errors."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import aiohttp
import pytest

from nodes.emulator.launch import PROJECT_ROOT as ROOT
from nodes.emulator.launch import launch


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_serves_n_ports_and_stops_cleanly(http: aiohttp.ClientSession, sig: signal.Signals) -> None:
    """N workers answer on P..P+N-1 after the ready line; SIGTERM/SIGINT ends the process with 0
    and closes every port, even with a request in flight."""
    emu = launch(["--profile", "mi300x", "--workers", "3", "--speed", "5"])
    try:
        ports = [int(u.rsplit(":", 1)[1]) for u in emu.urls]
        assert ports == [ports[0], ports[0] + 1, ports[0] + 2]
        for url in emu.urls:
            async with http.get(url + "/v1/models") as resp:
                assert resp.status == 200
        body = {"text": "x", "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True}}
        in_flight = asyncio.create_task(http.post(emu.urls[0] + "/generate", json=body))
        await asyncio.sleep(0.5)
        emu.proc.send_signal(sig)
        assert await asyncio.to_thread(emu.proc.wait, 15) == 0
        response = await in_flight
        assert (await response.json())["meta_info"]["finish_reason"]["type"] == "abort"
        for port in ports:
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0
    finally:
        emu.stop()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--profile", "h100"], "invalid choice"),
        (["--profile", "mi300x", "--speed", "0"], "must be > 0"),
        (["--profile", "mi300x", "--workers", "0"], "must be >= 1"),
        (["--profile", "mi300x", "--slowdown", "0.5"], "must be >= 1"),
        (["--profile", "mi300x", "--port", "65535", "--workers", "4"], "runs past port 65535"),
    ],
)
def test_bad_arguments_are_explained(args: list[str], fragment: str) -> None:
    """Bad flags end with exit code 2 and a one-line reason, not a traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "nodes.emulator", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


def test_port_in_use_is_reported() -> None:
    """A port already taken ends the process with exit code 1 and a logged reason."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "nodes.emulator", "--profile", "mi355x", "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 1
    assert "emulator.bind_failed" in proc.stderr and "Traceback" not in proc.stderr
