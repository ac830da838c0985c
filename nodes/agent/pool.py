"""The site's SGLang workers: health, load, and which one takes the next request.

Inside a site every worker is the same GPU, so the agent balances by the work each
one still has to do (tokens it may yet produce), not by request count: one long
answer weighs more than three short ones.

A worker is given only a few requests more than it runs at once; the rest wait here, in
one queue for the site, and go to whichever worker frees a slot first. A request parked
in one worker's queue would wait for that worker even while another sits idle, and every
parked request would hold a connection (a site at MLPerf load has ~20 k requests open).

A request whose prompt's prefix a worker likely holds in its prefix cache goes to that worker,
as the sglang-router's `cache_aware` policy sends it, with its defaults: when at least
CACHE_THRESHOLD of the prompt's blocks are there, unless the workers' loads are out of balance
(the busiest runs BALANCE_ABS more than the idlest and BALANCE_REL times as many); otherwise to
the least loaded. What each worker holds is remembered from the block hashes the gateway sent
(core/prefixes.py), as the router remembers the text it sent each worker: an approximation,
but one that needs nothing from the workers and no prompt text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import structlog

from core.prefixes import BLOCK_TOKENS, PrefixDirectory
from core.settings import AgentTimings
from core.tiers import Tier, TieredQueue
from core.wire import WorkDone
from nodes.agent import sglang
from nodes.agent.accounting import WorkMeter
from nodes.agent.sglang import WorkerInfo, WorkerStats

log = structlog.get_logger("agent.pool")

# Requests a worker holds beyond its running limit: enough that a freed slot is refilled at
# its next step, without waiting for the agent to hear of it and send another.
HEADROOM_FRACTION = 0.02
HEADROOM_MIN = 4
# The sglang-router's cache_aware defaults (`--cache-threshold`, `--balance-abs-threshold`,
# `--balance-rel-threshold`, sglang-router 0.3.2).
CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5


@dataclass(slots=True)
class Worker:
    url: str
    healthy: bool = False
    failures: int = 0
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    stats: WorkerStats | None = field(default=None)
    info: WorkerInfo | None = None  # None until /server_info was read
    last_event_at: float = 0.0  # monotonic time of the last stream event any call on it received
    loading: bool = False  # its process started (`--launch`) and it has not been healthy since
    meter: WorkMeter = field(default_factory=WorkMeter)  # its own accounting of its work, read stretch by stretch
    read_at: float = 0.0  # monotonic time its /metrics last answered

    @property
    def incremental(self) -> bool:
        """Streams deltas (SGLang's --incremental-streaming-output); cumulative until known."""
        return bool(self.info and self.info.incremental)

    @property
    def has_room(self) -> bool:
        limit = self.info.max_running_requests if self.info else None
        if limit is None:
            return True
        return self.outstanding_requests < limit + max(HEADROOM_MIN, round(limit * HEADROOM_FRACTION))


class NoHealthyWorker(Exception):
    pass


class WorkerPool:
    def __init__(
        self,
        urls: list[str],
        session: aiohttp.ClientSession,
        timings: AgentTimings = AgentTimings(),
        serves: tuple[str, str] | None = None,
    ) -> None:
        """`serves`: the (served model, tokenizer) every worker must say it serves, when the
        site already registered them (launched workers come up after it did)."""
        self.workers = [Worker(url) for url in urls]
        self.serves = serves
        self.any_healthy = asyncio.Event()  # set once some worker has passed a health check
        self.session = session
        self.timings = timings  # the site's, shared with whoever calls the workers
        # Requests waiting for a slot, with their prompts' block hashes, by service tier.
        self._waiters: TieredQueue[tuple[asyncio.Future[Worker], tuple[int, ...]]] = TieredQueue()
        self.prefixes = PrefixDirectory()  # which worker was sent which prefix blocks (by url)
        self.work = WorkDone()  # what the workers say they did, since the agent started (nodes.agent.accounting)

    @property
    def healthy_count(self) -> int:
        return sum(w.healthy for w in self.workers)

    @property
    def waiting(self) -> int:
        """Requests queued at the agent for a free worker slot."""
        return len(self._waiters)

    def waiting_by_tier(self) -> dict[str, int]:
        return self._waiters.counts()

    @property
    def accounting_count(self) -> int:
        """Healthy workers whose /metrics carry their own accounting of their work."""
        return sum(w.healthy and w.stats is not None and w.stats.accounting is not None for w in self.workers)

    @property
    def slots(self) -> int:
        """Requests the healthy workers run at once (0: they do not say)."""
        return sum(w.info.max_running_requests or 0 for w in self.workers if w.healthy and w.info)

    async def acquire(self, prefix_hashes: tuple[int, ...] = (), tier: Tier = Tier.DEFAULT) -> Worker:
        """A healthy worker with room, reserved for one request (the one likely to hold its prompt's
        prefix, if any: module docstring); waits for a free slot behind the requests of its own
        service tier that came before it and those of higher tiers (core/tiers.py)."""
        if not self.healthy_count:
            raise NoHealthyWorker("no healthy worker at this site")
        worker = None if self._waiters else self._pick(prefix_hashes)
        if worker is not None:
            self._take(worker, prefix_hashes)
            return worker
        waiter = asyncio.get_running_loop().create_future()
        entry = (waiter, prefix_hashes)
        self._waiters.append(tier, entry)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())  # handed a slot just as the caller left
            else:  # _dispatch may have dropped it already
                self._waiters.remove(tier, entry)
            raise

    def _take(self, worker: Worker, prefix_hashes: tuple[int, ...]) -> None:
        worker.outstanding_requests += 1
        self.prefixes.record(worker.url, prefix_hashes)

    def release(self, worker: Worker) -> None:
        worker.outstanding_requests -= 1
        self._dispatch()

    def _pick(self, prefix_hashes: tuple[int, ...] = ()) -> Worker | None:
        """The healthy worker with room likely to hold the prompt's prefix, while the loads are in
        balance; else the one with the least work still to do."""
        candidates = [w for w in self.workers if w.healthy and w.has_room]
        if not candidates:
            return None
        least = min(candidates, key=lambda w: (w.outstanding_tokens, w.outstanding_requests))
        if not prefix_hashes:
            return least
        loads = [w.outstanding_requests for w in self.workers if w.healthy]
        if max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads):
            return least
        cached = self.prefixes.cached_tokens([w.url for w in candidates], prefix_hashes)
        holder = max(candidates, key=lambda w: cached[w.url])
        held = cached[holder.url] / (len(prefix_hashes) * BLOCK_TOKENS)
        return holder if held >= CACHE_THRESHOLD else least

    def _dispatch(self) -> None:
        while (head := self._waiters.head()) is not None:
            waiter, prefix_hashes = head
            worker = self._pick(prefix_hashes)
            if worker is None:
                return
            self._waiters.popleft()
            if not waiter.done():
                self._take(worker, prefix_hashes)
                waiter.set_result(worker)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._read_then_check(w) for w in self.workers))

    async def _read_then_check(self, worker: Worker) -> None:
        await self._read(worker)
        await self._check(worker)

    async def check_forever(self) -> None:
        """Per worker, one loop reads its /metrics and another checks its health, so that neither
        a hung worker slows the others nor a slow /health (SGLang's is a generation, queued behind
        the load) spaces the reads its accounting is timed by (nodes.agent.accounting)."""
        await asyncio.gather(
            *(self._every_interval(w, self._read) for w in self.workers),
            *(self._every_interval(w, self._check) for w in self.workers),
        )

    async def _every_interval(self, worker: Worker, action: Callable[[Worker], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(self.timings.health_interval_s)
            try:
                await action(worker)
            except Exception:  # a bug in one read or check must not end them
                log.exception("worker.check_failed", worker=worker.url)

    def starting(self, worker: Worker) -> None:
        """Its process (re)started: nothing it said before holds; it loads until healthy."""
        self.mark_failed(worker)
        worker.loading, worker.info, worker.stats, worker.failures = True, None, None, 0
        worker.meter.reset()
        self.prefixes.forget(worker.url)  # it holds nothing it held before

    async def _read(self, worker: Worker) -> None:
        """Its /metrics: its load, and the stretch of its own accounting this read closes."""
        stats = await sglang.scrape(self.session, worker.url, self.timings.health_timeout_s)
        if stats is None:
            return
        self._count_work(worker, stats)
        worker.stats, worker.read_at = stats, time.monotonic()

    async def _check(self, worker: Worker) -> None:
        checked_at = time.monotonic()
        if worker.info is None:
            worker.info = await sglang.server_info(self.session, worker.url, self.timings.health_timeout_s)
            if worker.info is not None and not self._serves_ours(worker):
                worker.info = None  # asked again at its next check: it may be restarted right
                return
        health = await sglang.health(self.session, worker.url, self.timings.health_timeout_s)
        # Its /metrics answered lately (its reads come every interval): a hung worker's do not.
        recent = time.monotonic() - 2 * self.timings.health_interval_s
        stats = worker.stats if worker.stats is not None and worker.read_at >= recent else None
        if health is sglang.Health.SLOW and stats is not None and stats.running_requests + stats.queued_requests:
            return  # saturated, not sick: its metrics answer and it has work (decoding, or prefilling)
        if health is sglang.Health.OK and stats is not None and worker.info is not None:
            if not worker.healthy:
                log.info("worker.healthy", worker=worker.url)
            worker.healthy, worker.failures, worker.loading = True, 0, False
            self.any_healthy.set()
            self._dispatch()
            return
        if health is not sglang.Health.FAILING and worker.last_event_at >= checked_at:
            # Unanswered, but its answers flowed meanwhile: a worker too busy to answer in time, or
            # this loop stalled past the timeout (a collection, a burst). Streams are the proof of
            # life that matters: giving it up would cut every one of them. (A worker that streams
            # but takes no new request keeps its place until its streams end; then its checks
            # count, and the requests waiting at it fail over.)
            worker.failures = 0
            return
        worker.failures += 1
        if worker.healthy and worker.failures >= self.timings.failures_to_unhealthy:
            worker.healthy = False
            log.warning("worker.unhealthy", worker=worker.url, failures=worker.failures)
            self._fail_waiters_if_none_healthy()

    def _serves_ours(self, worker: Worker) -> bool:
        info = worker.info
        if self.serves is None or info is None or (info.served_model, info.tokenizer) == self.serves:
            return True
        log.error(
            "worker.serves_another_model",
            worker=worker.url,
            serves=[info.served_model, info.tokenizer],
            site_serves=list(self.serves),
        )
        return False

    def _count_work(self, worker: Worker, stats: sglang.WorkerStats) -> None:
        """Add the stretch of work this read closes, if it closes one, to the site's total."""
        if stats.accounting is None:
            return
        done = worker.meter.add(stats.accounting, mixed_chunk=bool(worker.info and worker.info.mixed_chunk))
        if done is not None:
            self.work = self.work + done

    def mark_failed(self, worker: Worker) -> None:
        """A request saw the worker break: stop sending it work until a check passes."""
        if worker.healthy:
            worker.healthy = False
            log.warning("worker.unhealthy", worker=worker.url, reason="request failed")
            self._fail_waiters_if_none_healthy()

    def _fail_waiters_if_none_healthy(self) -> None:
        """With no healthy worker left, the queue would wait for one that may never come back:
        every waiting request fails now, so the gateway sends it to another site."""
        if self.healthy_count or not self._waiters:
            return
        log.warning("site.no_healthy_worker", failed_waiting=len(self._waiters))
        while self._waiters:
            waiter, _ = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(NoHealthyWorker("the site lost every worker while this request waited"))
