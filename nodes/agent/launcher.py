"""The site's SGLang workers as this agent's children (`--launch`): started from the site's
recipe, waited for through their model load, started again when they die, stopped with it.

One child per worker, each `python -m sglang.launch_server` with the recipe's command line on
its own port and GPUs (core/recipes.py); `--launch emulator` starts the emulator with the same
command line instead, so the embedded federation runs this very path on CPU. The launcher knows
processes, the pool knows health: a worker is *loading* from its process's start until the
pool first finds it healthy (its model loaded and its health check answered), and the site
reports how many are (a site whose every worker loads is joining, not down). A worker that
does not come up within the recipe's `load_timeout_s` is killed and started again; one that
dies is started again after a backoff that doubles while it keeps dying before it comes up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from core import recipes
from core.processes import PROJECT_ROOT, die_with_parent
from core.recipes import Recipe
from core.settings import AgentTimings
from nodes.agent.pool import Worker, WorkerPool

log = structlog.get_logger("agent.launcher")


@dataclass(slots=True)
class Launched:
    """One worker's process and its history."""

    worker: Worker
    command: list[str]
    env: dict[str, str]
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    failures_in_a_row: int = 0  # deaths before coming up since it last came up: the backoff's exponent


class Launcher:
    def __init__(
        self,
        recipe: Recipe,
        program: str,
        model: str,
        host: str,
        first_port: int,
        pool: WorkerPool,
        timings: AgentTimings,
        env: Mapping[str, str] = {},
        first_gpu: int = 0,
    ) -> None:
        """`program`: "sglang" or "emulator" (core.recipes.PROGRAMS); `env`: added to ours for
        every worker (the emulator's settings); `pool`: holds a worker per URL of `urls(...)`;
        `first_gpu`: the host's first GPU the workers take."""
        self.recipe = recipe
        self.timings = timings
        self._pool = pool
        self.on_restart: Callable[[], None] = lambda: None  # counted in the agent's metrics
        self._stopping = False
        base = {**os.environ, **env}
        if program == "emulator":
            base["PYTHONPATH"] = str(PROJECT_ROOT)
        self.children = [
            Launched(
                worker,
                [
                    sys.executable,
                    *recipes.PROGRAMS[program],
                    *recipes.command_line(recipe, model, host, first_port + i),
                ],
                recipes.worker_env(recipe, i, base, first_gpu),
            )
            for i, worker in enumerate(pool.workers)
        ]
        self._tasks: list[asyncio.Task[None]] = []

    @staticmethod
    def urls(recipe: Recipe, gpus: int, host: str, first_port: int) -> list[str]:
        """The workers' URLs, one per `recipe.gpus_per_worker` GPUs; RecipeError if they do not split."""
        return [f"http://{host}:{first_port + i}" for i in range(recipe.workers(gpus))]

    def start(self) -> None:
        """Start every worker and keep them running until `stop`."""
        self._tasks = [asyncio.ensure_future(self._keep_running(c)) for c in self.children]

    async def _keep_running(self, child: Launched) -> None:
        while not self._stopping:
            try:
                await self._spawn(child)
                came_up = await self._watch(child)
            except OSError as exc:  # could not start it at all (no memory, no such program)
                log.error("worker.launch_failed", worker=child.worker.url, error=str(exc))
                came_up = False
            if self._stopping:
                return
            child.failures_in_a_row = 0 if came_up else child.failures_in_a_row + 1
            delay = min(self.timings.restart_max_s, self.timings.restart_base_s * 2**child.failures_in_a_row)
            log.warning("worker.restarting", worker=child.worker.url, in_s=round(delay, 1), restarts=child.restarts + 1)
            await asyncio.sleep(delay)
            child.restarts += 1
            self.on_restart()

    async def _spawn(self, child: Launched) -> None:
        self._pool.starting(child.worker)
        child.started_at = time.monotonic()
        child.process = await asyncio.create_subprocess_exec(
            *child.command,
            env=child.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=sys.stderr,  # our stdout carries our own ready line only
            preexec_fn=die_with_parent,
        )
        log.info(
            "worker.launched", worker=child.worker.url, pid=child.process.pid, gpus=child.env["HIP_VISIBLE_DEVICES"]
        )

    async def _watch(self, child: Launched) -> bool:
        """Until the process ends (or is ended for loading too long); whether it came up first."""
        assert child.process is not None
        came_up = False
        while True:
            try:
                async with asyncio.timeout(self.timings.health_interval_s):
                    code = await child.process.wait()
                break
            except TimeoutError:
                pass
            if not child.worker.loading:
                came_up = True
            elif time.monotonic() - child.started_at > self.recipe.load_timeout_s:
                log.error("worker.load_timed_out", worker=child.worker.url, after_s=self.recipe.load_timeout_s)
                child.process.kill()
        came_up = came_up or not child.worker.loading
        if not self._stopping:
            log.error("worker.exited", worker=child.worker.url, code=code, came_up=came_up)
            self._pool.mark_failed(child.worker)
        return came_up

    async def stop(self) -> None:
        """SIGTERM every worker (SGLang stops serving and exits), SIGKILL those still there after
        `worker_stop_s`."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        running = [c.process for c in self.children if c.process is not None and c.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.timings.worker_stop_s):
                await asyncio.gather(*(p.wait() for p in running))
        except TimeoutError:
            for process in running:
                if process.returncode is None:
                    log.warning("worker.killed", pid=process.pid)
                    process.kill()
            await asyncio.gather(*(p.wait() for p in running))
