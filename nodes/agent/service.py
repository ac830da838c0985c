"""The SiteAgent gRPC service: Generate streams a worker's tokens back, coalesced; Abort.

A stream is one gRPC message per coalescing window, not per token: at MLPerf scale a
site produces ~140 k tokens/s, far more messages than gRPC could carry one by one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import grpc
import structlog

from federation import wire
from federation.work import expected_output_tokens
from nodes.agent import sglang
from nodes.agent.pool import NoHealthyWorker, Worker, WorkerPool

log = structlog.get_logger("agent")

COALESCE_S = 0.05  # tokens produced within this window travel in one message


class _Ledger:
    """Work in flight at the site and per worker: what the reports and the balancing use."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0

    def open(self, worker: Worker, tokens: int) -> None:
        self.requests += 1
        worker.outstanding_requests += 1
        self.tokens += tokens
        worker.outstanding_tokens += tokens

    def settle(self, worker: Worker, tokens: int) -> None:
        self.tokens -= tokens
        worker.outstanding_tokens -= tokens

    def close(self, worker: Worker, tokens_left: int) -> None:
        self.settle(worker, tokens_left)
        self.requests -= 1
        worker.outstanding_requests -= 1


class SiteAgentService(wire.SiteAgentServicer):
    def __init__(self, site: str, pool: WorkerPool, session: aiohttp.ClientSession) -> None:
        self.site = site
        self.pool = pool
        self.session = session
        self.ledger = _Ledger()
        self._in_flight: dict[str, Worker] = {}
        self._aborts: set[asyncio.Future[None]] = set()  # keep them alive until they finish

    async def Generate(self, request, context) -> AsyncIterator:
        try:
            req = wire.generate_request_from_pb(request)
            worker = self.pool.pick()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoHealthyWorker as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        max_new = req.sampling_params.get("max_new_tokens")
        expected = expected_output_tokens(max_new if isinstance(max_new, int) else 0)
        payload: dict = {"rid": req.request_id, "sampling_params": req.sampling_params}
        if req.input_ids:
            payload["input_ids"] = list(req.input_ids)
        else:
            payload["text"] = req.text
        self.ledger.open(worker, expected)
        self._in_flight[req.request_id] = worker
        counted = 0
        bound = log.bind(request_id=req.request_id, site=self.site, worker=worker.url)
        try:
            async for chunk in self._coalesced(sglang.stream_generate(self.session, worker.url, payload), worker):
                now_counted = min(chunk.completion_tokens, expected)
                self.ledger.settle(worker, now_counted - counted)
                counted = now_counted
                yield wire.chunk_to_pb(chunk)
        except sglang.WorkerRejected as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except sglang.WorkerFailed as exc:
            self.pool.mark_failed(worker)
            bound.warning("generate.worker_failed", error=str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"site {self.site}: {exc}")
        except asyncio.CancelledError:
            bound.info("generate.cancelled")
            task = asyncio.ensure_future(sglang.abort(self.session, worker.url, req.request_id))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise
        finally:
            self._in_flight.pop(req.request_id, None)
            self.ledger.close(worker, expected - counted)

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
        rid = wire.abort_request_from_pb(request)
        worker = self._in_flight.get(rid)
        if worker is not None:
            await sglang.abort(self.session, worker.url, rid)
        return wire.abort_reply_to_pb(worker is not None)

    def report(self) -> wire.SiteReport:
        stats = [w.stats for w in self.pool.workers if w.healthy and w.stats is not None]
        return wire.SiteReport(
            site=self.site,
            healthy_workers=self.pool.healthy_count,
            total_workers=len(self.pool.workers),
            running_requests=sum(s.running_requests for s in stats),
            queued_requests=sum(s.queued_requests for s in stats),
            kv_usage=sum(s.token_usage for s in stats) / len(stats) if stats else 0.0,
            gen_throughput_tok_s=sum(s.gen_throughput_tok_s for s in stats),
            outstanding_requests=self.ledger.requests,
            outstanding_tokens=self.ledger.tokens,
        )
