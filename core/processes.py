"""Child processes that announce themselves: start, wait for the ready line, stop.

Every long-running program of ours prints one JSON line with `"event": "ready"` on
stdout once it serves; waiting for that line means no caller races a port that is
not listening yet.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 60.0  # an agent waits for its 16 emulated workers; CI machines are slow


class StartFailed(RuntimeError):
    pass


# Where free ports are picked: "LOW-HIGH", below the usual ephemeral range by default. Processes
# that pick ports side by side (the test suite's workers) each take a range of their own, and the
# processes they start inherit it, so that two of them cannot pick the same port at once.
PORT_RANGE_ENV = "FEDERATION_PORT_RANGE"
DEFAULT_PORT_RANGE = (20_000, 32_000)


class PortRangeError(ValueError):
    """PORT_RANGE_ENV is set to something that is not a range of ports."""


def port_range() -> tuple[int, int]:
    """The range free ports are picked from (PORT_RANGE_ENV, else DEFAULT_PORT_RANGE); a value
    that is not LOW-HIGH within 1024-65535 is refused, not ignored."""
    value = os.environ.get(PORT_RANGE_ENV, "")
    if not value:
        return DEFAULT_PORT_RANGE
    low, _, high = value.partition("-")
    if low.isdigit() and high.isdigit() and 1024 <= int(low) < int(high) <= 65535:
        return int(low), int(high)
    raise PortRangeError(f"{PORT_RANGE_ENV}={value!r}: expected LOW-HIGH, 1024 <= LOW < HIGH <= 65535")


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A first port P such that P..P+count-1 are all free on `host` right now."""
    low, high = port_range()
    for _ in range(200):
        base = random.randint(low, high - count)
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
    raise StartFailed(f"no block of {count} free ports on {host}")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    ready: dict[str, Any]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, so a parent that is killed (not
    stopped) leaves no orphan behind: no emulator holding ports after its agent is gone."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_python(
    name: str,
    module: str,
    args: Sequence[str],
    *,
    wrapper: Sequence[str] = (),
    timeout_s: float = READY_TIMEOUT_S,
    log: IO[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Child:
    """Run `python -m MODULE ARGS` (optionally under `wrapper`, with `env` added to ours) and wait
    for its ready line. Its log lines (stderr) go to `log`, or to ours."""
    return wait_ready(spawn_python(name, module, args, wrapper=wrapper, log=log, env=env), timeout_s)


def spawn_python(
    name: str,
    module: str,
    args: Sequence[str],
    *,
    wrapper: Sequence[str] = (),
    log: IO[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Child:
    """`start_python` without the wait: the child, its `ready` empty until `wait_ready` reads its
    line (processes that start slowly, such as sites loading, start side by side)."""
    cmd = [*wrapper, sys.executable, "-m", module, *args]
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(PROJECT_ROOT)}
    proc = subprocess.Popen(
        cmd,
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        preexec_fn=die_with_parent if sys.platform == "linux" else None,
    )
    return Child(name, proc, {})


def wait_ready(child: Child, timeout_s: float = READY_TIMEOUT_S) -> Child:
    """`child` once it printed its ready line (its `ready`); StartFailed, the child killed, when it
    exits or stays silent past `timeout_s` first."""
    proc = child.proc
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([proc.stdout], [], [], left)
        if not readable:
            break  # silent past the deadline: hung
        line = proc.stdout.readline()
        if not line:
            break  # exited
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "ready":
            child.ready = event
            return child
    proc.kill()
    raise StartFailed(f"{child.name} did not get ready (exit code {proc.wait()}): {_command_line(proc)}")


def _command_line(proc: subprocess.Popen[str]) -> str:
    args = proc.args
    return " ".join(map(str, args)) if isinstance(args, list | tuple) else str(args)
