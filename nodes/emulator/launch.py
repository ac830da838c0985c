"""Start emulator processes from other programs (benchmarks, tests, `fedctl`) and stop them.

The emulator announces itself with one JSON `ready` line on stdout; this waits for it,
so a caller never races a port that is not listening yet.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 30.0  # tokenizer load + synthetic text build take ~2 s; CI machines are slower


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A first port P such that P..P+count-1 are all free on `host` right now."""
    for _ in range(200):
        base = random.randint(20_000, 32_000 - count)  # below the usual ephemeral range
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
    raise RuntimeError(f"no block of {count} free ports on {host}")


@dataclass
class EmulatorProcess:
    proc: subprocess.Popen[str]
    urls: list[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def launch(args: Sequence[str], *, host: str = "127.0.0.1", wrapper: Sequence[str] = ()) -> EmulatorProcess:
    """Run `python -m nodes.emulator ARGS --host HOST --port <free block>` and wait until ready."""
    workers = int(args[list(args).index("--workers") + 1]) if "--workers" in args else 1
    port = free_port_block(workers, host)
    cmd = [*wrapper, sys.executable, "-m", "nodes.emulator", *args, "--port", str(port), "--host", host]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        event = json.loads(line)
        if event.get("event") == "ready":
            return EmulatorProcess(proc, event["urls"])
    proc.kill()
    raise RuntimeError(f"emulator did not get ready (exit code {proc.wait()}): {' '.join(cmd)}")
