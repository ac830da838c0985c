"""Long-lived tasks that never die silently. Every one runs under one of two rules:

- `restarting`: a loop whose state lives outside it (a health check, an expiry sweep, a metrics
  flush). An exception is logged with its traceback and the loop starts again after a backoff
  that doubles from RESTART_FIRST_S to RESTART_MAX_S (back to the first once a run lasted
  RESTART_MAX_S), so a bug that recurs is a steady trickle of tracebacks, not a hot loop and
  not silence.
- `Supervisor.essential`: a task the process cannot serve without (the agent's report stream,
  its join probe). An exception is logged with its traceback and the process stops with exit
  code 1, so what supervises it (systemd, Kubernetes, `fedctl up`) starts it again.

A task that returns has ended as it should; cancelling one is how it is stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("supervise")

RESTART_FIRST_S = 0.1
RESTART_MAX_S = 10.0
EXIT_FAILED = 1


def restarting(name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
    """`run()` as a task, started again after a backoff whenever it raises."""
    return asyncio.ensure_future(_restart_forever(name, run))


async def _restart_forever(name: str, run: Callable[[], Awaitable[None]]) -> None:
    delay_s = RESTART_FIRST_S
    while True:
        started = time.monotonic()
        try:
            await run()
            return
        except Exception:
            if time.monotonic() - started >= RESTART_MAX_S:
                delay_s = RESTART_FIRST_S
            log.exception("task.restarting", task=name, after_s=delay_s)
        await asyncio.sleep(delay_s)
        delay_s = min(RESTART_MAX_S, delay_s * 2)


class Supervisor:
    """A process's essential tasks: the first to raise stops the process (`failed` is set and
    `exit_code` says 1); the process waits on `failed` beside its stop signal."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.exit_code = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._brief: set[asyncio.Task[None]] = set()

    def essential(self, name: str, awaitable: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(awaitable)
        task.add_done_callback(lambda done: self._ended(name, done))
        self._tasks.append(task)
        return task

    def brief(self, name: str, awaitable: Awaitable[None]) -> asyncio.Task[None]:
        """A short task under the same rule (one of many, a request's), forgotten once it ends."""
        task = asyncio.ensure_future(awaitable)
        self._brief.add(task)

        def ended(done: asyncio.Task[None]) -> None:
            self._brief.discard(done)
            self._ended(name, done)

        task.add_done_callback(ended)
        return task

    def _ended(self, name: str, task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            return
        log.error("task.failed", task=name, exc_info=(type(exc), exc, exc.__traceback__))
        self.exit_code = EXIT_FAILED
        self.failed.set()

    async def close(self) -> None:
        """Cancel what still runs, and wait for it to end."""
        tasks = [*self._tasks, *self._brief]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
