"""`fedctl status --watch`: the status table as the schedulers push it, run as an operator runs
it against a live federation, in each of its outputs (a pipe, a terminal, JSON Lines), until
Ctrl-C."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.config import load
from core.processes import PROJECT_ROOT
from federation.embedded import Federation
from federation.status_view import CLEAR_SCREEN
from tests.conftest import SITES, fedctl
from tests.test_federation import _config

INTERVAL_S = 0.5
FIRST_OUTPUT_S = 30.0  # fedctl's start and its first state: seconds on a busy machine
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$")


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Federation, Path]]:
    """Korea and the US, two scheduler replicas (the watch follows one), shared by this module."""
    path, _ = _config(tmp_path_factory.mktemp("watch"), SITES, scheduler="replicas: 2")
    fed = Federation(load(path))
    try:
        fed.up()
        yield fed, path
    finally:
        fed.down()


class Watch:
    """`fedctl status --watch` running, its output gathered as it comes (from a pty when
    `terminal`, so that it sees a terminal, else from a pipe)."""

    def __init__(self, config: Path, *flags: str, terminal: bool = False) -> None:
        master, stdout = pty.openpty() if terminal else (-1, subprocess.PIPE)
        command = ["status", "--watch", "--interval-s", str(INTERVAL_S), "--config", str(config), *flags]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "federation.cli", *command],
            cwd=PROJECT_ROOT,
            stdout=stdout,
            stderr=subprocess.PIPE,
        )
        if terminal:
            os.close(stdout)
        self._output = b""
        self._changed = threading.Condition()
        fd = master if terminal else self.proc.stdout.fileno()
        threading.Thread(target=self._gather, args=(fd,), daemon=True).start()

    def _gather(self, fd: int) -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty reads EIO once the process has gone
                chunk = b""
            with self._changed:
                self._output += chunk
                self._changed.notify_all()
            if not chunk:
                return

    def output_when(self, done: Callable[[str], bool], timeout_s: float = FIRST_OUTPUT_S) -> str:
        """The output so far, once `done` holds for it; AssertionError when it does not in time."""
        with self._changed:
            if not self._changed.wait_for(lambda: done(self._output.decode()), timeout_s):
                raise AssertionError(f"not seen within {timeout_s} s; the watch printed:\n{self._output.decode()}")
            return self._output.decode()

    def interrupt(self) -> tuple[int, str]:
        """Ctrl-C: the exit code and what it printed on stderr."""
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=15)
        return code, self.proc.stderr.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _updates(output: str) -> list[dict]:
    """The objects of the complete lines (the last may still be coming)."""
    return [json.loads(line) for line in output[: output.rfind("\n") + 1].splitlines()]


def _states(update: dict) -> dict[str, str]:
    return {site["name"]: site["state"] for site in update["sites"]}


def test_plain_output_is_timestamped_tables_a_blank_line_apart(federation: tuple[Federation, Path]) -> None:
    """Piped, the watch prints one frame per update, each after a blank line and a timestamp: the
    sites' table, then the tiers' (each tier's queue and latency), with no terminal control codes;
    Ctrl-C ends it with exit 0 and nothing on stderr."""
    _, path = federation
    watch = Watch(path)
    try:
        output = watch.output_when(lambda out: out.count("schedulers: ") >= 3)
        code, errors = watch.interrupt()
    finally:
        watch.stop()
    assert (code, errors) == (0, "")
    assert "\x1b" not in output
    frames = output.split("\n\n")
    for frame in frames[:3]:
        stamp, header, *rows, schedulers = frame.strip("\n").splitlines()
        assert TIMESTAMP.match(stamp), stamp
        assert header.split()[:5] == ["name", "region", "gpu", "gpus", "state"]
        tiers_at = next(i for i, row in enumerate(rows) if row.split()[0] == "tier")
        rows, tiers = rows[:tiers_at], rows[tiers_at + 1 :]
        assert [row.split()[0] for row in tiers] == ["priority", "default", "flex"]
        assert sorted(row.split()[0] for row in rows) == ["kr-mi300x", "us-mi355x"]
        assert all(row.split()[4] == "ready" for row in rows)
        assert " watching" in schedulers
    assert len({frame.splitlines()[0] for frame in frames[:3]}) >= 2  # half a second apart: the clock moved


def test_a_terminal_is_redrawn_in_place(federation: tuple[Federation, Path]) -> None:
    """On a terminal each update clears the screen and draws the table from its top left."""
    _, path = federation
    watch = Watch(path, terminal=True)
    try:
        output = watch.output_when(lambda out: out.count(CLEAR_SCREEN) >= 3)
        code, errors = watch.interrupt()
    finally:
        watch.stop()
    assert (code, errors) == (0, "")
    frames = output.split(CLEAR_SCREEN)
    assert frames[0] == ""  # nothing before the first clear
    for frame in frames[1:3]:
        stamp, header, *_ = frame.splitlines()
        assert TIMESTAMP.match(stamp.strip()), stamp
        assert header.startswith("name ")
        assert "kr-mi300x" in frame and "us-mi355x" in frame


def test_json_lines_follow_a_drain(federation: tuple[Federation, Path]) -> None:
    """With --json, one JSON object per line per update; `fedctl site drain` is in the first
    update the watched replica pushes after the command returns."""
    _, path = federation
    watch = Watch(path, "--json")
    try:
        before = _updates(watch.output_when(lambda out: out.count("\n") >= 2))
        assert [_states(u) for u in before[:2]] == [{"kr-mi300x": "ready", "us-mi355x": "ready"}] * 2
        drain = fedctl("site", "drain", "kr-mi300x", "--no-wait", "--config", str(path), timeout_s=60)
        assert drain.returncode == 0, drain.stderr
        pushed_after = time.time() + 0.1  # stamped later than this: pushed after every replica had the drain
        output = watch.output_when(lambda out: any(u["at_unix_s"] >= pushed_after for u in _updates(out)), 15)
        after = next(u for u in _updates(output) if u["at_unix_s"] >= pushed_after)
        code, errors = watch.interrupt()
    finally:
        watch.stop()
        fedctl("site", "undrain", "kr-mi300x", "--config", str(path), timeout_s=60)
    assert (code, errors) == (0, "")
    assert _states(after) == {"kr-mi300x": "draining", "us-mi355x": "ready"}
    assert after["degraded"] is False and "watching" in after["schedulers"].values()


def test_a_failed_replica_is_left_for_another(federation: tuple[Federation, Path]) -> None:
    """When the watched replica dies the watch goes on from the other, and says which it watches."""
    fed, path = federation
    first, second = fed.config.scheduler_addresses
    watch = Watch(path, "--json")
    try:
        watch.output_when(lambda out: any(u["schedulers"][first] == "watching" for u in _updates(out)))
        fed.restart_scheduler(0)  # killed, then started again empty
        moved = watch.output_when(lambda out: any(u["schedulers"][second] == "watching" for u in _updates(out)), 15)
        code, errors = watch.interrupt()
    finally:
        watch.stop()
    assert (code, errors) == (0, "")
    last = _updates(moved)[-1]
    assert last["schedulers"][first] != "watching"
    assert set(_states(last)) == {"kr-mi300x", "us-mi355x"}
