"""One generation across as many sites as it takes: retry before the first token, resume after.

Before the client has a token, a failed site is simply replaced: the request is routed again,
without the sites that failed it and without sites whose circuit is open, with jittered
backoff, until its retry budget is spent. After the first token, the answer is resumed:
another site continues from the prompt plus the tokens already sent (as token ids, so
nothing is tokenised twice), with the rest of the token budget. The client's stream goes on
where it stopped and its token count continues, so usage stays exact.

Limits, by design: structured output (`json_schema`, `regex`, `ebnf`) is not resumed, since
its grammar would restart mid-answer; such a request fails clearly instead. A stop string
that straddles the cut is not matched. Sampling after the cut is the new site's (the answer
is a valid continuation, not the one the first site would have written).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

from core import runtime, tokens, wire
from core.errors import NoCapacity, SiteWorkerFailed, UpstreamFailed
from core.settings import GatewayTimings
from federation.gateway import metrics, spans
from federation.gateway.pieces import Chunk, Job
from federation.gateway.schedulers import Schedulers
from federation.gateway.upstream import SiteStream, Upstream

log = structlog.get_logger("gateway")

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # what a /generate without max_new_tokens gets
STRUCTURED_OUTPUT_PARAMS = ("json_schema", "regex", "ebnf")
# Built once: tenacity's predicate refers to itself (a cycle per request otherwise; core/runtime.retried).
RETRY_ON_SITE_FAILURE = retry_if_exception_type((UpstreamFailed, NoCapacity))


# How long a request may look for a site that serves it, from its arrival or from a failure:
# long enough to ride out a site's loss and the schedulers noticing it (~1 s), and a restart.
# The time a site held it before failing (queued behind thousands, it may be minutes) is not
# looking: a request whose worker died after it had waited 40 s still gets its retries.


@dataclass(frozen=True, slots=True)
class FailoverConfig:
    retry_budget_s: float = GatewayTimings().retry_budget_s
    resume: bool = True  # continue a stream cut mid-answer on another site
    max_resumes: int = 4  # per request: a request that breaks every site it lands on is the problem


@dataclass(slots=True)
class SiteBreakers:
    """Per-site circuit breakers, on the sites' own faults only (broken streams, timeouts,
    refusals), never on a client's bad request. A site that failed `failures_to_open` requests
    in a row gets no new ones here for `open_s` (open); then exactly one request is let through
    (half-open): its first token closes the circuit, its failure opens it again, and while it is
    out every other request goes elsewhere. A trial that ends without a verdict (the client
    left, one worker broke) lets the next request be the trial."""

    failures_to_open: int  # GatewayTimings.circuit_failures
    open_s: float  # GatewayTimings.circuit_open_s
    _failures: dict[str, int] = field(default_factory=dict)
    _opened_at: dict[str, float] = field(default_factory=dict)
    _trials: set[str] = field(default_factory=set)  # half-open sites whose one trial is out

    def failed(self, site: str) -> None:
        self._trials.discard(site)
        self._failures[site] = self._failures.get(site, 0) + 1
        if self._failures[site] >= self.failures_to_open:
            if site not in self._opened_at or self._expired(site):
                log.warning("site.circuit_open", site=site, failures=self._failures[site])
                metrics.CIRCUIT_OPENED.labels(site).inc()
            self._opened_at[site] = time.monotonic()
            metrics.CIRCUIT_OPEN.labels(site).set(1)

    def succeeded(self, site: str) -> None:
        self._failures.pop(site, None)
        self._trials.discard(site)
        if self._opened_at.pop(site, None) is not None:
            log.info("site.circuit_closed", site=site)
            metrics.CIRCUIT_OPEN.labels(site).set(0)

    def no_verdict(self, site: str) -> None:
        """The site's trial ended saying nothing of the site: the next request may be its trial."""
        self._trials.discard(site)

    def open_sites(self) -> set[str]:
        """Sites routes must exclude: open, or half-open with their trial out."""
        return {site for site in self._opened_at if site in self._trials or not self._expired(site)}

    def admit(self, site: str) -> bool:
        """A route chose `site`: False if its circuit is open or its trial is out (routes decided
        concurrently may all have chosen a site just half-open); True makes a half-open site's
        request its trial."""
        if site not in self._opened_at:
            return True
        if site in self._trials or not self._expired(site):
            return False
        self._trials.add(site)
        log.info("site.circuit_half_open", site=site)
        return True

    def _expired(self, site: str) -> bool:
        return time.monotonic() - self._opened_at[site] >= self.open_s


Route = Callable[[wire.RouteRequest], Awaitable[wire.RouteDecision]]


_new = tuple.__new__  # a tuple's own constructor: half the NamedTuple's, at the token rate


class AnswerSink(Protocol):
    """Where a generation's chunks go, as they arrive from the sites."""

    def chunk(self, chunk: Chunk) -> None:
        """A chunk, in order; called as the site's deltas are read (it must not block)."""

    def flow(self, text: str, output_ids: tuple[int, ...], completion_tokens: int, site: str) -> None:
        """A chunk from the middle of the answer (no finish, no logprobs), as its fields: at the
        token rate, a sink may write it without a Chunk built for it."""

    async def opened(self, site: str) -> None:
        """The answer has begun (its first chunk came from `site`): the client may be answered."""

    def constrained_output_begun(self) -> bool:
        """Whether a grammar on the answer (json_schema, regex, ebnf) shapes what was sent already."""


class Generation:
    """One job's answer, as if from one site. `route` decides the first site (latency mode may
    hold it); later ones come straight from the schedulers."""

    def __init__(
        self,
        job: Job,
        route_request: wire.RouteRequest,
        route: Route,
        schedulers: Schedulers,
        upstream: Upstream,
        breakers: SiteBreakers,
        config: FailoverConfig,
        out: AnswerSink,
    ) -> None:
        self.job, self.route_request = job, route_request
        self._first_route: Route | None = route
        self.schedulers, self.upstream, self.breakers, self.config = schedulers, upstream, breakers, config
        self._out = out
        self.retries = 0
        self.resumed = 0
        # Of the prompt, the tokens found in prefix caches: by the sites that failed it, and by the
        # one answering now (each delta that carries it says it again).
        self._cached_before = self._cached_now = 0
        self.sites: list[str] = []  # every site that sent this answer tokens, in order
        self.accepted_unix_s = 0.0  # when the first site's agent took the request (wall clock)
        self.routed_at: float | None = None  # when the first route was decided (time.monotonic())
        self._tried: set[str] = set()  # sites that failed this request since it last made progress
        self._held_s = 0.0  # seconds sites held it before failing it, in this search for a site (not in the budget)
        self._produced = 0  # tokens the client has been sent
        self._offset = 0  # tokens produced before the current site took over
        self._id_parts: list[tuple[int, ...]] = []  # every token id sent, from every site
        self._text_parts: list[str] = []
        self._delivered = False  # a chunk went to the sink
        self._opened = False  # and the sink heard that the answer began

    async def run(self) -> None:
        """Returns once the whole answer went to the sink; raises a FederationError when it
        cannot be completed. Cancelling it cancels the site's generation."""
        request = self.job.request
        while True:
            decision, stream = await self._open(request)
            try:
                if not self._opened and self._delivered:
                    self._opened = True
                    await self._out.opened(decision.site)
                await stream.done
                return
            except UpstreamFailed as exc:
                self._failed(decision.site, exc)
                self._cached_before, self._cached_now = self._cached_before + self._cached_now, 0
                continuation = self._continuation(exc)
                if continuation is None:  # every token asked for was sent: only the finish was lost
                    self._deliver(self._finished_by_length(decision.site))
                    return
                request = continuation
                self.resumed += 1
                log.warning(
                    "request.resuming",
                    request_id=request.request_id,
                    failed_site=decision.site,
                    sent_tokens=self._produced,
                    error=exc.message,
                )
            finally:
                stream.close()

    def _deliver(self, chunk: Chunk) -> None:
        self._delivered = True
        self._out.chunk(chunk)

    def _on_flow(self, site: str, text: str, output_ids: tuple[int, ...], completion_tokens: int) -> None:
        """The middle of a site's answer (SiteStream.flowed), most of its deltas: no finish to read."""
        self._delivered = True
        self._out.flow(text, output_ids, self._count(site, text, output_ids, completion_tokens), site)

    def _on_delta(self, site: str, stream: SiteStream, delta: wire.TokenDelta) -> None:
        """A site's delta, as the upstream reads it (at the token rate: the common case first).
        SGLang's abort finish means the worker gave up on the request: the site failed it (its
        tokens so far still count)."""
        finish = delta.finish_reason
        if finish is None:
            self._deliver(self._continued(delta, None, site))
            return
        aborted = finish.get("type") == "abort"
        if delta.output_ids or delta.text or not aborted:
            self._deliver(self._continued(delta, None if aborted else finish, site))
        if aborted:
            stream.fail(UpstreamFailed(f"site {site} aborted the generation"))

    # ---- opening a site's stream ---------------------------------------------------------

    async def _open(self, request: wire.GenerateRequest):
        """(decision, stream) from the first site that starts answering."""
        self._held_s = 0.0
        retrying = AsyncRetrying(
            retry=RETRY_ON_SITE_FAILURE,
            wait=wait_random_exponential(multiplier=0.05, max=1.0),
            stop=self._budget_spent,
            reraise=True,
            before_sleep=self._count_retry,
        )
        return await runtime.retried(retrying, self._attempt, request)

    def _budget_spent(self, state: RetryCallState) -> bool:
        return (state.seconds_since_start or 0.0) - self._held_s >= self.config.retry_budget_s

    def _count_retry(self, state) -> None:
        self.retries += 1
        log.info("request.retrying", request_id=self.job.request.request_id, error=str(state.outcome.exception()))

    async def _attempt(self, request: wire.GenerateRequest) -> tuple[wire.RouteDecision, SiteStream]:
        exclude = self._tried | self.breakers.open_sites()
        route_request = dataclasses.replace(self.route_request, exclude_sites=tuple(sorted(exclude)))
        route, self._first_route = self._first_route or self.schedulers.route, None
        try:
            decision = await spans.routed(route, route_request)
            self.routed_at = self.routed_at or time.monotonic()
        except NoCapacity:
            self._tried.clear()  # every site failed it once: each may be tried again after the backoff
            raise
        if not self.breakers.admit(decision.site):
            self._tried.add(decision.site)
            raise UpstreamFailed(f"site {decision.site}'s circuit opened while this request was routed")
        stream = spans.start_at_site(
            self.upstream,
            decision,
            request,
            partial(self._on_delta, decision.site),
            partial(self._on_flow, decision.site),
            self._produced,
        )
        sent_at = time.monotonic()
        try:
            first = await stream.first
        except UpstreamFailed as exc:
            stream.close()
            self._held_s += time.monotonic() - sent_at
            self._failed(decision.site, exc)
            raise
        except BaseException:
            stream.close()
            self.breakers.no_verdict(decision.site)
            raise
        self.accepted_unix_s = self.accepted_unix_s or first.accepted_unix_s
        self.breakers.succeeded(decision.site)
        self._tried.clear()
        self.sites.append(decision.site)
        return decision, stream

    def _failed(self, site: str, failure: UpstreamFailed) -> None:
        """A site failed this request. One of its workers breaking is not the site failing: a
        lost worker takes hundreds of streams with it, and the site's other workers serve on."""
        if isinstance(failure, SiteWorkerFailed):
            self.breakers.no_verdict(site)
            return
        self._tried.add(site)
        self.breakers.failed(site)

    # ---- resuming ------------------------------------------------------------------------

    def _continued(self, delta: wire.TokenDelta, finish: dict[str, Any] | None, site: str) -> Chunk:
        """The delta as the client's one stream sees it: token count continued across sites."""
        produced = self._count(site, delta.text, delta.output_ids, delta.completion_tokens)
        if finish is not None and self._offset and finish.get("type") == "length":
            finish = {**finish, "length": self._max_new_tokens}
        self._cached_now = delta.cached_tokens or self._cached_now
        cached = self._cached_before + self._cached_now
        return _new(Chunk, (delta.text, delta.output_ids, produced, finish, site, delta.logprobs, delta.top, cached))

    def _count(self, site: str, text: str, output_ids: tuple[int, ...], completion_tokens: int) -> int:
        """Keep what a site sent (a resume sends it to the next) and count it; returns the tokens
        the client has been sent, continued across sites."""
        self._id_parts.append(output_ids)
        self._text_parts.append(text)
        produced = self._offset + completion_tokens
        if produced > self._produced:
            metrics.RELAYED[site] += produced - self._produced
        self._produced = produced
        return produced

    @property
    def _max_new_tokens(self) -> int:
        asked = self.job.request.sampling_params.get("max_new_tokens")
        return asked if isinstance(asked, int) and asked > 0 else SGLANG_DEFAULT_MAX_NEW_TOKENS

    def _continuation(self, failure: UpstreamFailed) -> wire.GenerateRequest | None:
        """The request another site continues the answer with; None when nothing is left to
        generate. Raises the failure when the answer cannot be resumed."""
        original = self.job.request
        params = dict(original.sampling_params)

        def refuse(why: str) -> UpstreamFailed:
            return UpstreamFailed(f"{failure.message}; not resumed: {why}")

        if not self.config.resume:
            raise refuse("resuming is turned off")
        if self.resumed >= self.config.max_resumes:
            raise refuse(f"already resumed {self.resumed} times")
        structured = [p for p in STRUCTURED_OUTPUT_PARAMS if params.get(p)]
        if structured and self._out.constrained_output_begun():  # a grammar starts at the generation's start
            raise refuse(f"structured output ({structured[0]}) cannot continue mid-document on another site")
        left = self._max_new_tokens - self._produced
        if left <= 0:
            return None
        ids = list(itertools.chain.from_iterable(self._id_parts))
        params["max_new_tokens"] = left
        if isinstance(params.get("min_new_tokens"), int):
            params["min_new_tokens"] = max(0, params["min_new_tokens"] - self._produced)
        self._offset = self._produced
        prompt_tokens = original.prompt_tokens + self._produced
        if len(ids) == self._produced:
            prompt_ids = list(original.input_ids) if original.input_ids else tokens.encode(original.text)
            return dataclasses.replace(
                original,
                prompt_tokens=prompt_tokens,
                sampling_params=params,
                text="",
                input_ids=(*prompt_ids, *ids),
                resumed_tokens=self._produced,
            )
        if original.text and not original.input_ids:  # the site sent text without ids: continue the text
            sent = "".join(self._text_parts)
            return dataclasses.replace(
                original,
                prompt_tokens=prompt_tokens,
                sampling_params=params,
                text=original.text + sent,
                resumed_tokens=self._produced,
            )
        raise refuse("the site did not send token ids")

    def _finished_by_length(self, site: str) -> Chunk:
        finish = {"type": "length", "length": self._max_new_tokens}
        return Chunk("", (), self._produced, finish, site, cached_tokens=self._cached_before + self._cached_now)
