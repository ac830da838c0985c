"""Start our real processes for tests: free loopback ports, a ready line, a clean stop."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 30.0


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A first port P such that P..P+count-1 are all free on `host` right now."""
    for _ in range(200):
        base = random.randint(20_000, 60_000 - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.bind((host, port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


@dataclass
class Emulator:
    proc: subprocess.Popen[str]
    urls: list[str]

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_emulator(*args: str, host: str = "127.0.0.1", netns: str | None = None) -> Emulator:
    """Run `python -m nodes.emulator ARGS` on a free port block and wait for its ready line."""
    workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 1
    port = free_port_block(workers, host if netns is None else "127.0.0.1")
    cmd = [sys.executable, "-m", "nodes.emulator", *args, "--port", str(port), "--host", host]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=None,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        event = json.loads(line)
        if event.get("event") == "ready":
            return Emulator(proc, event["urls"])
    proc.kill()
    raise RuntimeError(f"emulator did not get ready: exit {proc.wait()}")
