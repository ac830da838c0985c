"""The site's SGLang workers: health, load, and which one takes the next request.

Inside a site every worker is the same GPU, so the agent balances by the work each
one still has to do (tokens it may yet produce), not by request count: one long
answer weighs more than three short ones.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import structlog

from nodes.agent import sglang
from nodes.agent.sglang import WorkerStats

log = structlog.get_logger("agent.pool")

HEALTH_INTERVAL_S = 1.0  # how often each worker is checked
HEALTH_TIMEOUT_S = 5.0  # SGLang's /health runs a 1-token generation: slow under load, not dead
FAILURES_TO_UNHEALTHY = 2  # one missed check is noise; two in a row is a sick worker


@dataclass(slots=True)
class Worker:
    url: str
    healthy: bool = False
    failures: int = 0
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    stats: WorkerStats | None = field(default=None)
    incremental: bool | None = None  # streams deltas; None until /server_info was read


class NoHealthyWorker(Exception):
    pass


class WorkerPool:
    def __init__(self, urls: list[str], session: aiohttp.ClientSession) -> None:
        self.workers = [Worker(url) for url in urls]
        self.session = session

    @property
    def healthy_count(self) -> int:
        return sum(w.healthy for w in self.workers)

    def pick(self) -> Worker:
        """The healthy worker with the least work still to do."""
        candidates = [w for w in self.workers if w.healthy]
        if not candidates:
            raise NoHealthyWorker("no healthy worker at this site")
        return min(candidates, key=lambda w: (w.outstanding_tokens, w.outstanding_requests))

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers))

    async def check_forever(self) -> None:
        """One loop per worker, so a hung worker cannot slow the checks of the others."""
        await asyncio.gather(*(self._watch(w) for w in self.workers))

    async def _watch(self, worker: Worker) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await self._check(worker)
            except Exception:  # a bug in one check must not end health checking
                log.exception("worker.check_failed", worker=worker.url)

    async def _check(self, worker: Worker) -> None:
        if worker.incremental is None:
            worker.incremental = await sglang.streams_incrementally(self.session, worker.url, HEALTH_TIMEOUT_S)
        health, stats = await asyncio.gather(
            sglang.health(self.session, worker.url, HEALTH_TIMEOUT_S),
            sglang.scrape(self.session, worker.url, HEALTH_TIMEOUT_S),
        )
        if stats is not None:
            worker.stats = stats
        if health is sglang.Health.SLOW and stats is not None and stats.running_requests > 0:
            return  # saturated, not sick: its metrics answer and it is generating
        if health is sglang.Health.OK and stats is not None and worker.incremental is not None:
            if not worker.healthy:
                log.info("worker.healthy", worker=worker.url)
            worker.healthy, worker.failures = True, 0
            return
        worker.failures += 1
        if worker.healthy and worker.failures >= FAILURES_TO_UNHEALTHY:
            worker.healthy = False
            log.warning("worker.unhealthy", worker=worker.url, failures=worker.failures)

    def mark_failed(self, worker: Worker) -> None:
        """A request saw the worker break: stop sending it work until a check passes."""
        if worker.healthy:
            worker.healthy = False
            log.warning("worker.unhealthy", worker=worker.url, reason="request failed")
