"""The SiteAgent gRPC service: Generate streams a worker's tokens back, coalesced; Abort.

A stream is one gRPC message per coalescing window, not per token: at MLPerf scale a
site produces ~140 k tokens/s, far more messages than gRPC could carry one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import aiohttp
import grpc
import structlog

from federation import wire
from federation.work import expected_output_tokens
from nodes.agent import sglang
from nodes.agent.delivered import DeliveredRate
from nodes.agent.join import JoinGate
from nodes.agent.pool import NoHealthyWorker, Worker, WorkerPool

log = structlog.get_logger("agent")

COALESCE_S = 0.05  # tokens produced within this window travel in one message
# An Offline run can queue a request behind thousands at a site: its first token may take
# many minutes. Once tokens flow, a worker silent for a minute is broken, not busy.
FIRST_TOKEN_TIMEOUT_S = 1800.0
BETWEEN_EVENTS_TIMEOUT_S = 60.0
# A request whose worker never answered goes to another, up to this many tries in all (each
# marks the worker it tried unhealthy until its health check passes).
CONNECT_ATTEMPTS = 3


class _Ledger:
    """Work in flight at the site (queued here or at a worker) and per worker: what the reports
    and the balancing use."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        # Request ids of the Generate calls taken (served or refused) since the last report:
        # the schedulers' acknowledgement of their routes.
        self.received_ids: list[str] = []

    def arrive(self, tokens: int) -> None:
        self.requests += 1
        self.tokens += tokens

    def leave(self, tokens: int) -> None:
        """A request that never reached a worker."""
        self.requests -= 1
        self.tokens -= tokens

    def assign(self, worker: Worker, tokens: int) -> None:
        worker.outstanding_tokens += tokens

    def settle(self, worker: Worker, tokens: int) -> None:
        self.tokens -= tokens
        worker.outstanding_tokens -= tokens

    def close(self, worker: Worker, tokens_left: int) -> None:
        self.settle(worker, tokens_left)
        self.requests -= 1


class SiteAgentService(wire.SiteAgentServicer):
    def __init__(
        self, site: str, pool: WorkerPool, session: aiohttp.ClientSession, gate: JoinGate, address: str
    ) -> None:
        self.site = site
        self.pool = pool
        self.session = session
        self.gate = gate
        self.address = address  # what the site registers: where the gateways dial it
        self.ledger = _Ledger()
        self.delivered = DeliveredRate()
        self._in_flight: dict[str, tuple[Worker, str]] = {}  # request id -> (worker, worker rid)
        self._aborts: set[asyncio.Future[None]] = set()  # keep them alive until they finish

    async def Generate(self, request, context) -> AsyncIterator:
        self.ledger.received_ids.append(request.request_id)
        try:
            req = wire.generate_request_from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        max_new = req.sampling_params.get("max_new_tokens")
        expected = expected_output_tokens(max_new if isinstance(max_new, int) else 0)
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            worker = await self._acquire(expected, context)
            try:
                async for pb in self._relay(req, worker, expected, context):
                    yield pb
                return
            except sglang.WorkerUnreachable as exc:
                # The worker never answered: another one takes the request, unseen by the client.
                log.warning("generate.worker_unreachable", request_id=req.request_id, attempt=attempt, error=str(exc))
                if attempt == CONNECT_ATTEMPTS:
                    await context.abort(grpc.StatusCode.ABORTED, f"site {self.site}: {exc}")

    async def _acquire(self, expected: int, context) -> Worker:
        """A worker slot for a request expected to produce `expected` tokens, counted in the ledger
        while it waits and runs; aborts the call if the site has no healthy worker or no slot in time."""
        self.ledger.arrive(expected)
        try:
            async with asyncio.timeout(FIRST_TOKEN_TIMEOUT_S):
                return await self.pool.acquire()
        except BaseException as exc:
            self.ledger.leave(expected)
            if isinstance(exc, NoHealthyWorker):
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            if isinstance(exc, TimeoutError):
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"site {self.site}: no worker slot in time")
            raise

    async def _relay(self, req: wire.GenerateRequest, worker: Worker, expected: int, context) -> AsyncIterator:
        """The worker's answer, coalesced into gRPC messages; the worker's slot and the ledger are
        settled when it ends, however it ends. Raises WorkerUnreachable if the worker never answered."""
        # The worker's rid is ours, fixed-length and unique: SGLang aborts by rid *prefix*,
        # so a client's id must never be able to name another client's request.
        rid = "fed-" + uuid.uuid4().hex
        payload: dict = {"rid": rid, "sampling_params": req.sampling_params}
        if req.input_ids:
            payload["input_ids"] = list(req.input_ids)
        else:
            payload["text"] = req.text
        entry = (worker, rid)
        self.ledger.assign(worker, expected)
        self._in_flight[req.request_id] = entry
        counted, relayed, worker_done = 0, 0, False
        bound = log.bind(request_id=req.request_id, rid=rid, site=self.site, worker=worker.url)
        deltas = sglang.stream_generate(
            self.session,
            worker.url,
            payload,
            incremental=worker.incremental,
            first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S,
            between_events_timeout_s=BETWEEN_EVENTS_TIMEOUT_S,
        )
        try:
            async with contextlib.aclosing(self._coalesced(deltas, worker)) as chunks:
                async for chunk in chunks:
                    self.delivered.add(chunk.completion_tokens - relayed)
                    relayed = chunk.completion_tokens
                    now_counted = min(chunk.completion_tokens, expected)
                    self.ledger.settle(worker, now_counted - counted)
                    counted = now_counted
                    worker_done = chunk.finish_reason is not None
                    yield wire.chunk_to_pb(chunk)
        except sglang.WorkerRejected as exc:
            worker_done = True
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except sglang.WorkerUnreachable:
            self.pool.mark_failed(worker)
            worker_done = True
            raise
        except sglang.WorkerFailed as exc:
            self.pool.mark_failed(worker)
            # A lost connection ended the request at the worker: no abort to send (a dead
            # worker takes hundreds of streams with it, and their aborts would only be refused).
            worker_done = exc.connection_lost
            bound.warning("generate.worker_failed", error=str(exc))
            # ABORTED, not UNAVAILABLE: the site still serves on its other workers, so the
            # gateway may send the request (or its continuation) right back here.
            await context.abort(grpc.StatusCode.ABORTED, f"site {self.site}: {exc}")
        finally:
            # Cancelled, closed mid-send (GeneratorExit) or failed: the worker must stop too.
            if not worker_done:
                bound.info("generate.aborting")
                self._abort_soon(worker, rid)
            if self._in_flight.get(req.request_id) is entry:
                del self._in_flight[req.request_id]
            self.ledger.close(worker, expected - counted)
            self.pool.release(worker)

    def _abort_soon(self, worker: Worker, rid: str) -> None:
        task = asyncio.ensure_future(sglang.abort(self.session, worker.url, rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def close(self) -> None:
        """Let the aborts already sent finish before the HTTP session closes."""
        await asyncio.gather(*self._aborts, return_exceptions=True)

    async def _coalesced(
        self, deltas: AsyncIterator[sglang.Delta], worker: Worker
    ) -> AsyncIterator[wire.GenerateChunk]:
        """The first token at once, then one chunk per window, and the finish at once."""
        text: list[str] = []
        ids: list[int] = []
        last_sent = 0.0
        sent_any = False
        last: sglang.Delta | None = None
        async for d in deltas:
            text.append(d.text)
            ids.extend(d.output_ids)
            now = time.monotonic()
            if not sent_any or d.finish_reason is not None or now - last_sent >= COALESCE_S:
                yield wire.GenerateChunk(
                    "".join(text),
                    tuple(ids),
                    d.completion_tokens,
                    d.prompt_tokens,
                    d.finish_reason,
                    self.site,
                    worker.url,
                )
                text, ids, last_sent, sent_any = [], [], now, True
            last = d
        if ids and last is not None:  # a stream that ended without a finish event still delivers what it had
            yield wire.GenerateChunk(
                "".join(text), tuple(ids), last.completion_tokens, last.prompt_tokens, None, self.site, worker.url
            )

    async def Abort(self, request, context):
        entry = self._in_flight.get(wire.abort_request_from_pb(request))
        if entry is not None:
            worker, rid = entry
            await sglang.abort(self.session, worker.url, rid)
        return wire.abort_reply_to_pb(entry is not None)

    async def Join(self, request, context):
        refusal = self.gate.join(wire.join_request_from_pb(request), context)
        if refusal is not None:
            log.warning("agent.join_refused", site=self.site, reason=refusal[1])
            await context.abort(*refusal)
        log.info("agent.joined", site=self.site, schedulers=list(request.schedulers))
        return wire.join_reply_to_pb(self.site, self.address)

    def next_report(self) -> wire.SiteReport:
        """The site's load now, with the calls taken since the previous one (handed over once)."""
        received, self.ledger.received_ids = self.ledger.received_ids, []
        stats = [w.stats for w in self.pool.workers if w.healthy and w.stats is not None]
        return wire.SiteReport(
            site=self.site,
            healthy_workers=self.pool.healthy_count,
            total_workers=len(self.pool.workers),
            running_requests=sum(s.running_requests for s in stats),
            queued_requests=sum(s.queued_requests for s in stats) + self.pool.waiting,
            kv_usage=sum(s.token_usage for s in stats) / len(stats) if stats else 0.0,
            gen_throughput_tok_s=sum(s.gen_throughput_tok_s for s in stats),
            delivered_tok_s=self.delivered.sample(),
            outstanding_requests=self.ledger.requests,
            outstanding_tokens=self.ledger.tokens,
            slots=self.pool.slots,
            context_tokens=sum(s.used_tokens for s in stats),
            received_ids=tuple(received),
            prompt_tokens_total=round(self.pool.finished_prompt_tokens),
            generation_tokens_total=round(self.pool.finished_output_tokens),
        )
