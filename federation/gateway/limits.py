"""Per-key limits, held across every gateway process that shares a port.

A client's requests land on any of the processes sharing the port (SO_REUSEPORT), so a key's
limits live in one SQLite file they all open (`--limits-db`, by default the directory their
shared metrics use; one process alone keeps them in memory): one short transaction when a
request starts and one when it ends, never per token. Rates are token buckets refilled
continuously, a minute's worth at most: `rpm` requests and `tpm` tokens a minute. A request is
admitted when its key has a request left, its prompt's tokens left, and fewer than
`max_concurrent` requests running; its output tokens are taken as it ends (a long answer can
make the next request wait, as OpenAI counts them too). A refusal says how long until the
request would fit (Retry-After), and is made before any site is asked. Running requests are
counted per process: those of a gateway that died stop counting.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Protocol

from core.errors import RateLimited
from federation.gateway.keys import KeyLimits

LOCK_WAIT_S = 2.0  # another process's transaction takes well under a millisecond
CONCURRENCY_RETRY_S = 1

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS buckets (key TEXT, kind TEXT, level REAL, at REAL, PRIMARY KEY (key, kind))",
    "CREATE TABLE IF NOT EXISTS running (key TEXT, pid INTEGER, n INTEGER, PRIMARY KEY (key, pid))",
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


Release = Callable[[int], None]  # called with a request's output tokens when it ends


class KeyLimiter(Protocol):
    """What a gateway asks of its keys' limits: this file's `Limiter` (the processes of one
    machine) or `quota.RegionQuota` (every gateway of every region, #45)."""

    async def admit(self, key: str, limits: KeyLimits, prompt_tokens: int) -> Release: ...


def over_prompt(limits: KeyLimits, prompt_tokens: int) -> None:
    """Refuse a prompt bigger than the key's whole minute of tokens: it could never be admitted."""
    if limits.tpm and prompt_tokens > limits.tpm:
        raise RateLimited(
            f"The prompt is {prompt_tokens} tokens; this key may use {limits.tpm} tokens a minute.",
            retry_after_s=60,
        )


class Limiter:
    def __init__(self, path: Path | None = None) -> None:
        self._db = sqlite3.connect(str(path) if path else ":memory:", timeout=LOCK_WAIT_S, isolation_level=None)
        if path:
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=OFF")  # counts, not records: a crash may lose the last few
        for statement in _SCHEMA:
            self._db.execute(statement)
        self._pid = os.getpid()
        self._db.execute("DELETE FROM running WHERE pid = ?", (self._pid,))  # a previous process of this pid

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    async def admit(self, key: str, limits: KeyLimits, prompt_tokens: int) -> Release:
        """Count a request of `key` starting, or raise RateLimited; returns what to call with its
        output tokens when it ends."""
        self.take(key, limits, prompt_tokens)
        return partial(self.release, key, limits)

    def take(self, key: str, limits: KeyLimits, prompt_tokens: int) -> None:
        """Count a request of `key` starting (`release` it when it ends), or raise RateLimited."""
        if not (limits.rpm or limits.tpm or limits.max_concurrent):
            return
        over_prompt(limits, prompt_tokens)
        now = time.time()
        with self._transaction() as db:
            waits: list[tuple[str, int, float]] = []
            if limits.max_concurrent and self._running(db, key) >= limits.max_concurrent:
                waits.append(("max_concurrent", limits.max_concurrent, CONCURRENCY_RETRY_S))
            levels = {}
            for kind, per_minute, cost in (("rpm", limits.rpm, 1), ("tpm", limits.tpm, prompt_tokens)):
                if per_minute:
                    levels[kind] = level = self._level(db, key, kind, per_minute, now)
                    if level < cost:
                        waits.append((kind, per_minute, (cost - level) * 60 / per_minute))
            if waits:
                what, limit, wait_s = max(waits, key=lambda w: w[2])
                raise RateLimited(
                    f"This key is over its limit ({what} {limit}); retry in {math.ceil(wait_s)} s.",
                    retry_after_s=max(1, math.ceil(wait_s)),
                )
            for kind, cost in (("rpm", 1), ("tpm", prompt_tokens)):
                if kind in levels:
                    self._set(db, key, kind, levels[kind] - cost, now)
            if limits.max_concurrent:
                db.execute(
                    "INSERT INTO running VALUES (?, ?, 1) ON CONFLICT (key, pid) DO UPDATE SET n = n + 1",
                    (key, self._pid),
                )

    def release(self, key: str, limits: KeyLimits, output_tokens: int) -> None:
        """A request `admit` took has ended, with `output_tokens` generated."""
        if not (limits.tpm or limits.max_concurrent):
            return
        now = time.time()
        with self._transaction() as db:
            if limits.tpm and output_tokens:
                self._set(db, key, "tpm", self._level(db, key, "tpm", limits.tpm, now) - output_tokens, now)
            if limits.max_concurrent:
                db.execute("UPDATE running SET n = MAX(n - 1, 0) WHERE key = ? AND pid = ?", (key, self._pid))

    def _running(self, db: sqlite3.Connection, key: str) -> int:
        total = 0
        for pid, n in db.execute("SELECT pid, n FROM running WHERE key = ?", (key,)).fetchall():
            if _alive(pid):
                total += n
            else:
                db.execute("DELETE FROM running WHERE key = ? AND pid = ?", (key, pid))
        return total

    @staticmethod
    def _level(db: sqlite3.Connection, key: str, kind: str, per_minute: int, now: float) -> float:
        """The bucket's level now: what was left, refilled since, a minute's worth at most."""
        row = db.execute("SELECT level, at FROM buckets WHERE key = ? AND kind = ?", (key, kind)).fetchone()
        if row is None:
            return float(per_minute)
        level, at = row
        return min(float(per_minute), level + max(0.0, now - at) * per_minute / 60)

    @staticmethod
    def _set(db: sqlite3.Connection, key: str, kind: str, level: float, now: float) -> None:
        db.execute("INSERT OR REPLACE INTO buckets VALUES (?, ?, ?, ?)", (key, kind, level, now))

    def close(self) -> None:
        self._db.close()
