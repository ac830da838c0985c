"""The SiteAgent gRPC service: Generate relays many generations on one call per gateway; Join.

Each generation a gateway starts waits here for a worker slot, then streams from its worker
(`worker_stream`, read in callbacks); its tokens go back through the call's `RelayCall`,
coalesced in time and across generations. One watcher bounds every worker call's waits.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import dataclass

import aiohttp
import grpc
import structlog

from core import tracing, unreadable, wire
from core.authz import UNGUARDED, Guard
from core.tiers import Tier, sglang_priority
from core.work import expected_output_tokens
from nodes.agent import sglang, spans, worker_stream
from nodes.agent.delivered import DeliveredRate
from nodes.agent.join import JoinGate
from nodes.agent.metrics import AgentMetrics
from nodes.agent.pool import NoHealthyWorker, Worker, WorkerPool
from nodes.agent.readers import ReaderLost, ReaderPool, RemoteCall
from nodes.agent.relay import RelayCall, Relayed

log = structlog.get_logger("agent")

# Generations one call may hold at once: a gateway process holds at most ~20 k open requests
# (its file descriptors); far more from one caller is a fault or an attack, not load.
MAX_STREAMS_PER_CALL = 100_000


class SiteFailed(Exception):
    """The site cannot serve this generation (no healthy worker, no slot in time)."""


class _Ledger:
    """Work in flight at the site (queued here or at a worker) and per worker: what the reports
    and the balancing use."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.by_tier = [0] * len(Tier)  # of `requests`, how many of each service tier
        # Request ids of the Generate calls taken (served or refused) since the last report:
        # the schedulers' acknowledgement of their routes.
        self.received_ids: list[str] = []

    def arrive(self, tokens: int, tier: Tier) -> None:
        self.requests += 1
        self.tokens += tokens
        self.by_tier[tier] += 1

    def leave(self, tokens: int, tier: Tier) -> None:
        """A request that never reached a worker."""
        self.requests -= 1
        self.tokens -= tokens
        self.by_tier[tier] -= 1

    def assign(self, worker: Worker, tokens: int) -> None:
        worker.outstanding_tokens += tokens

    def settle(self, worker: Worker, tokens: int) -> None:
        self.tokens -= tokens
        worker.outstanding_tokens -= tokens

    def close(self, worker: Worker, tokens_left: int, tier: Tier) -> None:
        self.settle(worker, tokens_left)
        self.requests -= 1
        self.by_tier[tier] -= 1


@dataclass(slots=True)
class _Held:
    """A generation's share of its worker's ledger: what it was expected to produce, and how much
    of that its deltas have already settled."""

    worker: Worker
    expected: int
    counted: int = 0


def _forget(running: dict[int, asyncio.Task[None]], stream: int, _task: asyncio.Task[None]) -> None:
    """A generation ended: its stream number is free."""
    running.pop(stream, None)


class SiteAgentService(wire.SiteAgentServicer):
    def __init__(
        self,
        site: str,
        pool: WorkerPool,
        session: aiohttp.ClientSession,
        gate: JoinGate,
        address: str,
        guard: Guard = UNGUARDED,
        readers: ReaderPool | None = None,
    ) -> None:
        self.site = site
        self.guard = guard
        self.readers = readers  # the workers' streams read in other processes (--readers)
        self._start_call = readers.start if readers is not None else worker_stream.start
        self.timings = pool.timings
        self.pool = pool
        self.session = session
        self.gate = gate
        self.address = address  # what the site registers: where the gateways dial it
        # Launched workers come up after the site registered: until its join probe ran, the
        # healthy ones count as loading, so the site stays joining and gets no traffic.
        self.starting = False
        self.ledger = _Ledger()
        self.delivered = DeliveredRate()
        # The requests completed since the agent started, as their clients asked (`_count_completed`).
        self.completed_prompt_tokens = 0
        self.completed_output_tokens = 0
        self.metrics = AgentMetrics(site, pool, self.delivered)
        self._calls: dict[worker_stream.WorkerCall | RemoteCall, Worker] = {}  # to workers, for the watcher
        self._held: dict[Relayed, _Held] = {}  # generations at a worker: what they hold in the ledger
        self._aborts: set[asyncio.Future[None]] = set()  # keep them alive until they finish

    async def Generate(self, request_iterator, context) -> None:
        """Starts and cancels generations as the gateway asks, until the call ends; every
        generation still running then is cancelled (the gateway is gone)."""
        await self.guard.admit(context, "Generate")
        self.metrics.generate_calls.inc()
        flow = wire.TOKEN_FLOW_METADATA in (context.invocation_metadata() or ())
        relay = RelayCall(context.write, self._sent, self.timings.coalesce_s, flow=flow)
        writer = asyncio.ensure_future(relay.write_forever())
        running: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                pb = await context.read()
                if pb is grpc.aio.EOF:
                    break
                if unreadable.unreadable(pb):
                    await unreadable.abort(context, pb)
                command = wire.generate_command_from_pb(pb)
                for stream, why in command.refused:
                    self.metrics.finished["refused"]()
                    Relayed(relay, stream, False).fail(wire.StreamError.REJECTED, why)
                for stream, req in command.starts:
                    record = Relayed(relay, stream, req.every_event)
                    if stream in running or len(running) >= MAX_STREAMS_PER_CALL:
                        self.metrics.finished["refused"]()
                        record.fail(wire.StreamError.REJECTED, f"stream {stream} is in use, or too many on this call")
                        continue
                    task = asyncio.ensure_future(spans.generation(self._generate, self.site, req, record))
                    running[stream] = task
                    task.add_done_callback(functools.partial(_forget, running, stream))
                for stream in command.cancels:
                    if stream in running:
                        running[stream].cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)  # the gateway said no more
            await relay.drained()
        finally:
            for task in running.values():
                task.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    def _sent(self, record: Relayed, tokens: int) -> None:
        """`tokens` more of `record`'s left for its gateway: delivered, and no longer owed by its worker."""
        self.delivered.add(tokens)
        held = self._held.get(record)
        if held is not None:
            counted = min(record.sent_tokens, held.expected)
            self.ledger.settle(held.worker, counted - held.counted)
            held.counted = counted

    async def _generate(self, req: wire.GenerateRequest, record: Relayed) -> None:
        """One generation, from a worker slot to its last delta; failures become that delta."""
        self.ledger.received_ids.append(req.request_id)
        max_new = req.sampling_params.get("max_new_tokens")
        expected = expected_output_tokens(max_new if isinstance(max_new, int) else 0)
        bound = log.bind(request_id=req.request_id, site=self.site)
        outcome = "failed"
        try:
            for attempt in range(1, self.timings.connect_attempts + 1):
                worker = await self._acquire(expected, req.prefix_hashes, req.tier)
                try:
                    await spans.worker_call(
                        self._relay(req, worker, expected, record), req, self.site, worker.url, record
                    )
                    outcome = "completed"
                    self._count_completed(req, record)
                    return
                except sglang.WorkerUnreachable as exc:
                    # The worker never answered: another one takes the request, unseen by the client.
                    self.metrics.worker_unreachable.inc()
                    bound.warning("generate.worker_unreachable", attempt=attempt, error=str(exc))
                    if attempt == self.timings.connect_attempts:
                        raise
        except sglang.WorkerRejected as exc:
            outcome = "refused"
            record.fail(wire.StreamError.REJECTED, str(exc))
        except sglang.WorkerFailed as exc:
            # A worker broke, not the site: the gateway may send the request (or its
            # continuation) right back here, to the site's other workers.
            bound.warning("generate.worker_failed", error=str(exc))
            record.fail(wire.StreamError.WORKER_FAILED, f"site {self.site}: {exc}")
        except SiteFailed as exc:
            record.fail(wire.StreamError.SITE_FAILED, f"site {self.site}: {exc}")
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            # A bug of ours: the request ends now as the site's failure, so the gateway resumes
            # or retries it elsewhere at once instead of waiting out its deadline.
            bound.exception("generate.unexpected_error")
            if record.finish is None:  # else its answer was whole: the client has it
                record.fail(wire.StreamError.SITE_FAILED, f"site {self.site}: internal error ({type(exc).__name__})")
        finally:
            self.metrics.finished[outcome]()

    def _count_completed(self, req: wire.GenerateRequest, record: Relayed) -> None:
        """An answer ended as the client asked (stop, length): its work, as the client asked for it,
        counts toward the site's workload shape (a resumed answer's said tokens are its output, not
        its prompt; a prompt's cached tokens are no prefill)."""
        if (record.finish or {}).get("type") in ("stop", "length"):
            # What the GPU prefilled for it, as asked: less what a resume had said, and what the
            # worker found in its prefix cache.
            prompt = max(0, record.prompt_tokens - req.resumed_tokens - record.cached_tokens)
            output = record.completion_tokens + req.resumed_tokens
            self.completed_prompt_tokens += prompt
            self.completed_output_tokens += output
            self.metrics.completed_prompt_tokens.inc(prompt)
            self.metrics.completed_output_tokens.inc(output)

    async def _acquire(self, expected: int, prefix_hashes: tuple[int, ...], tier: Tier) -> Worker:
        """A worker slot for a request expected to produce `expected` tokens, counted in the ledger
        while it waits (in its service tier's place) and runs; SiteFailed if the site has no
        healthy worker or no slot in time."""
        self.ledger.arrive(expected, tier)
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timings.first_token_timeout_s):
                worker = await self.pool.acquire(prefix_hashes, tier)
            self.metrics.queue_wait.observe(time.monotonic() - started)
            return worker
        except BaseException as exc:
            self.ledger.leave(expected, tier)
            if isinstance(exc, NoHealthyWorker):
                raise SiteFailed(str(exc)) from None
            if isinstance(exc, TimeoutError):
                raise SiteFailed("no worker slot in time") from None
            raise

    async def _relay(self, req: wire.GenerateRequest, worker: Worker, expected: int, record: Relayed) -> None:
        """The worker's answer into `record`; the worker's slot and the ledger are settled when it
        ends, however it ends. Raises WorkerUnreachable if the worker never answered."""
        # The worker's rid is ours, fixed-length and unique: SGLang aborts by rid *prefix*,
        # so a client's id must never be able to name another client's request.
        rid = "fed-" + uuid.uuid4().hex
        payload: dict = {"rid": rid, "sampling_params": req.sampling_params}
        if req.input_ids:
            payload["input_ids"] = list(req.input_ids)
        else:
            payload["text"] = req.text
        if req.logprobs:  # SGLang's own fields for it, beside sampling_params
            payload["return_logprob"], payload["top_logprobs_num"] = True, req.top_logprobs
        info = worker.info
        if info is not None and info.priority_scheduling:  # only then: a worker may abort a request naming one
            payload["priority"] = sglang_priority(req.tier, info.low_priority_values_first)
        self.ledger.assign(worker, expected)
        held = self._held[record] = _Held(worker, expected)
        record.worker = worker.url
        call: worker_stream.WorkerCall | RemoteCall | None = None
        worker_done = False
        try:
            call = await self._start_call(
                worker.url,
                payload,
                incremental=worker.incremental,
                on_event=record.event,
                on_logprobs=record.logprobs if req.logprobs else None,
                heard=worker,
                connect_timeout_s=self.timings.connect_timeout_s,
                headers=tracing.outgoing(),
            )
            self._calls[call] = worker
            await call.done
            worker_done = True
        except sglang.WorkerRejected:
            worker_done = True
            raise
        except sglang.WorkerFailed as exc:
            # Given up by its health checks, or silent on every stream as long as one may be:
            # either way it is not running anything an abort could stop.
            silent_s = time.monotonic() - worker.last_event_at
            hung = (
                worker.failures >= self.timings.failures_to_unhealthy
                or silent_s > self.timings.between_events_timeout_s
            )
            if not isinstance(exc, ReaderLost):  # the agent's own reader died, not the worker
                self.pool.mark_failed(worker)
            # A lost connection ended the request at the worker, and a hung worker learns it from
            # the connection closed here: no abort to send (a dead or hung worker takes thousands
            # of streams with it, and their aborts would only be refused or queue behind the hang).
            worker_done = exc.connection_lost or hung
            raise
        finally:
            if call is not None:
                self._calls.pop(call, None)
                call.close()
            # Cancelled (the gateway gave up) or failed: the worker must stop too.
            if not worker_done:
                log.info("generate.aborting", request_id=req.request_id, rid=rid, worker=worker.url)
                self._abort_soon(worker, rid)
            del self._held[record]
            self.ledger.close(worker, expected - held.counted, req.tier)
            self.pool.release(worker)

    async def watch_calls(self) -> None:
        """Bounds every worker call's waits (one check a second for all of them, not a timer per
        read): no first event within `first_token_timeout_s`, or none for `between_events_timeout_s`
        after it, and the worker has failed the request. A worker its health checks gave up on
        (hung: connections open, nothing answers) fails its requests at once, so they go on
        elsewhere instead of waiting out those bounds."""
        while True:
            await asyncio.sleep(self.timings.call_check_s)
            now = time.monotonic()
            for call, worker in list(self._calls.items()):
                if worker.failures >= self.timings.failures_to_unhealthy:
                    call.fail(sglang.WorkerFailed("the worker stopped answering its health checks"))
                    continue
                if call.last_event_at is None:
                    silent_s, limit_s = now - call.started_at, self.timings.first_token_timeout_s
                else:
                    silent_s, limit_s = now - call.last_event_at, self.timings.between_events_timeout_s
                if silent_s > limit_s:
                    call.fail(sglang.WorkerFailed(f"the worker sent nothing for {limit_s:.0f} s"))

    def _abort_soon(self, worker: Worker, rid: str) -> None:
        task = asyncio.ensure_future(sglang.abort(self.session, worker.url, rid, self.timings.abort_timeout_s))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def close(self) -> None:
        """Let the aborts already sent finish before the HTTP session closes; stop the readers."""
        await asyncio.gather(*self._aborts, return_exceptions=True)
        if self.readers is not None:
            await self.readers.close()

    async def Join(self, request, context):
        await self.guard.admit(context, "Join")
        refusal = self.gate.join(wire.join_request_from_pb(request), context)
        if refusal is not None:
            log.warning("agent.join_refused", site=self.site, reason=refusal[1])
            await context.abort(*refusal)
        log.info("agent.joined", site=self.site, schedulers=list(request.schedulers))
        return wire.join_reply_to_pb(self.site, self.address)

    def next_report(self) -> wire.SiteReport:
        """The site's load now, with the calls taken since the previous one (handed over once).
        Called on the event loop's thread."""
        received, self.ledger.received_ids = self.ledger.received_ids, []
        stats = [w.stats for w in self.pool.workers if w.healthy and w.stats is not None]
        healthy, loading = self.pool.healthy_count, sum(w.loading for w in self.pool.workers)
        if self.starting:
            healthy, loading = 0, loading + healthy
        return wire.SiteReport(
            site=self.site,
            healthy_workers=healthy,
            loading_workers=loading,
            total_workers=len(self.pool.workers),
            running_requests=sum(s.running_requests for s in stats),
            queued_requests=sum(s.queued_requests for s in stats) + self.pool.waiting,
            kv_usage=sum(s.token_usage for s in stats) / len(stats) if stats else 0.0,
            gen_throughput_tok_s=sum(s.gen_throughput_tok_s for s in stats),
            delivered_tok_s=self.delivered.sample(),
            outstanding_requests=self.ledger.requests,
            outstanding_tokens=self.ledger.tokens,
            outstanding_by_tier=tuple(self.ledger.by_tier),
            slots=self.pool.slots,
            context_tokens=sum(s.used_tokens for s in stats),
            received_ids=tuple(received),
            prompt_tokens_total=self.completed_prompt_tokens,
            generation_tokens_total=self.completed_output_tokens,
            work=self.pool.work,
            accounting_workers=self.pool.accounting_count,
            loop_cpu_s=time.thread_time(),  # called on the loop's thread: its CPU, as cpu_clock's "loop"
            relayed_tokens_total=self.delivered.total,
        )
