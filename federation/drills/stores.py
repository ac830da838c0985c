"""A region's quota store for drills and tests: Debian's `redis-server` on a port of its own, run
as a store of keys is (its writes on disk within a second, so a restart keeps them), that
the caller can kill and start again."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

START_TIMEOUT_S = 10.0


class RedisServer:
    def __init__(self, port: int, where: Path) -> None:
        if shutil.which("redis-server") is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.port, self.where = port, where
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        where.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""),
                *("--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.where)),
            ],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        """As a crash: SIGKILL, nothing flushed but what was on disk."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
