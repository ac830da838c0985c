"""proto <-> domain dataclasses: the one module that touches generated protobuf code.

Servicers and clients receive pb2 messages from grpc; they call `from_pb` at once and
`to_pb` at the last moment, so the policy, registry and ledger only ever see the
frozen dataclasses below.
"""

from __future__ import annotations

import enum
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from core import prefixes
from core.tiers import Tier
from proto import federation_pb2 as pb
from proto import federation_pb2_grpc as pb_grpc

# What a request id may be, from a client (X-Request-Id) to a site: anything else is replaced at
# the gateway and refused at an agent.
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

SchedulerServicer = pb_grpc.SchedulerServicer
SiteAgentServicer = pb_grpc.SiteAgentServicer
SchedulerStub = pb_grpc.SchedulerStub
SiteAgentStub = pb_grpc.SiteAgentStub
add_scheduler_to_server = pb_grpc.add_SchedulerServicer_to_server
add_site_agent_to_server = pb_grpc.add_SiteAgentServicer_to_server


class SiteStatus(enum.Enum):
    JOINING = pb.SITE_STATUS_JOINING
    READY = pb.SITE_STATUS_READY
    DRAINING = pb.SITE_STATUS_DRAINING
    DOWN = pb.SITE_STATUS_DOWN

    @property
    def label(self) -> str:
        return self.name.lower()


class Command(enum.Enum):
    DRAIN = pb.COMMAND_DRAIN
    UNDRAIN = pb.COMMAND_UNDRAIN
    REMOVE = pb.COMMAND_REMOVE
    REPORT_EVERY = pb.COMMAND_REPORT_EVERY


@dataclass(frozen=True, slots=True)
class SiteRegistration:
    name: str
    region: str
    gpu: str
    gpus: int
    agent_address: str
    model: str
    probe_batch: float = 0.0  # the calibration probe, per worker (0: not run)
    probe_context_tokens: float = 0.0
    probe_tok_s: float = 0.0
    tokenizer: str = ""  # what the workers say they tokenize with ("": they do not say)
    draining: bool = False  # told to drain and not undrained since (a restarted replica learns it)
    checkpoint: str = ""  # what the workers load (SGLang's model_path; "": the served model's own)
    weight_format: str = ""  # mxfp4, fp8, bf16, ... ("": unknown)
    clock_speed: float = 1.0  # 1: real GPUs; an emulated site's --speed (see the proto)


@dataclass(frozen=True, slots=True)
class Registered:
    site: str
    prior_capacity_tok_s: float
    report_interval_s: float


@dataclass(frozen=True, slots=True)
class WorkDone:
    """What a site's workers say they did, summed over workers and over the stretches the agent
    could time (see the proto): cumulative, so a report lost or read late loses nothing."""

    busy_s: float = 0.0  # worker-seconds not idle
    passes: int = 0  # forward passes
    decode_seqs: float = 0.0  # sequences decoded, summed over passes
    context_ktokens: float = 0.0  # thousands of KV tokens those decodes attended to
    prefill_tokens: int = 0  # prompt tokens computed
    cached_tokens: int = 0  # prompt tokens found in the prefix cache

    def __add__(self, other: WorkDone) -> WorkDone:
        return self._plus(other, 1)

    def __sub__(self, other: WorkDone) -> WorkDone:
        return self._plus(other, -1)

    def _plus(self, other: WorkDone, sign: int) -> WorkDone:
        return WorkDone(
            self.busy_s + sign * other.busy_s,
            self.passes + sign * other.passes,
            self.decode_seqs + sign * other.decode_seqs,
            self.context_ktokens + sign * other.context_ktokens,
            self.prefill_tokens + sign * other.prefill_tokens,
            self.cached_tokens + sign * other.cached_tokens,
        )

    def any_negative(self) -> bool:
        return (
            min(
                self.busy_s,
                self.passes,
                self.decode_seqs,
                self.context_ktokens,
                self.prefill_tokens,
                self.cached_tokens,
            )
            < 0
        )


@dataclass(frozen=True, slots=True)
class SiteReport:
    site: str
    healthy_workers: int = 0
    total_workers: int = 0
    running_requests: int = 0
    queued_requests: int = 0
    kv_usage: float = 0.0
    gen_throughput_tok_s: float = 0.0
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    slots: int = 0
    context_tokens: int = 0
    received_ids: tuple[str, ...] = ()  # Generate calls taken since the previous report (see the proto)
    prompt_tokens_total: int = 0  # of the requests the site completed, as their clients asked (see the proto)
    generation_tokens_total: int = 0
    delivered_tok_s: float = 0.0  # output tokens/s the agent relayed, over recent seconds
    loading_workers: int = 0  # starting: loading their model, or the join probe still running
    work: WorkDone = WorkDone()  # the workers' own accounting, cumulative (see the proto)
    accounting_workers: int = 0  # healthy workers whose /metrics carry it
    loop_cpu_s: float = 0.0  # the agent's event loop's CPU seconds, cumulative
    relayed_tokens_total: int = 0  # output tokens the agent relayed, cumulative
    outstanding_by_tier: tuple[int, ...] = ()  # of outstanding_requests, how many of each tier (Tier's order)


@dataclass(frozen=True, slots=True)
class SchedulerCommand:
    command: Command
    reason: str = ""
    report_interval_s: float = 0.0  # REPORT_EVERY: report this often from now on


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int = 0  # 0: not given
    client_region: str = ""
    exclude_sites: tuple[str, ...] = ()
    dry_run: bool = False  # decide, but do not count the route
    prefix_hashes: tuple[int, ...] = ()  # the prompt's block hashes (core/prefixes.py)
    tier: Tier = Tier.DEFAULT  # the request's service tier (core/tiers.py)
    max_delay_s: float = 0.0  # the longest its first token may be expected to wait (0: no bound)

    def commits(self, decision: RouteDecision) -> bool:
        """Whether `decision` takes this request (counted at its site): not when only asked
        (a dry run), nor when it expects a longer wait than the request may have (refused)."""
        return not self.dry_run and not self.over_patience(decision)

    def over_patience(self, decision: RouteDecision) -> bool:
        """`decision` would start it later than it may wait: its gateway refuses it (429)."""
        return 0 < self.max_delay_s < decision.expected_delay_s


@dataclass(frozen=True, slots=True)
class RouteDecision:
    site: str
    agent_address: str
    expected_delay_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class RouteCall:
    """One route asked on a RouteStream call: `number` is the asker's, echoed in its answer."""

    number: int
    request: RouteRequest
    trace_context: tuple[tuple[str, str], ...] = ()  # the W3C trace context, when traced


@dataclass(frozen=True, slots=True)
class RouteAnswer:
    """A route's answer on a RouteStream call: a decision, or the gRPC status code (a
    `grpc.StatusCode`'s number) and message that Route would have ended with."""

    number: int
    decision: RouteDecision | None
    code: int = 0
    message: str = ""


@dataclass(frozen=True, slots=True)
class SiteState:
    name: str
    region: str
    gpu: str
    gpus: int
    agent_address: str
    status: SiteStatus
    capacity_tok_s: float
    outstanding_requests: int
    outstanding_tokens: int
    routed_requests: int
    healthy_workers: int
    total_workers: int
    last_report_age_s: float
    prior_capacity_tok_s: float = 0.0
    capacity_evidence: str = ""
    queued_requests: int = 0
    slots: int = 0
    admit_window: int = 0  # slow start: the slots routing may fill while the site proves itself; 0: all
    prefill_s_per_token: float = 0.0  # measured
    # Seconds since the status, and the healthy workers, last changed, by the scheduler's clock:
    # when it saw a change, however late an observer asks (a drill's detection time).
    status_age_s: float = 0.0
    workers_age_s: float = -1.0
    checkpoint: str = ""
    weight_format: str = ""
    loading_workers: int = 0
    running_requests: int = 0  # the workers' own counts, as last reported
    kv_usage: float = 0.0
    gen_throughput_tok_s: float = 0.0
    context_tokens: int = 0
    clock_speed: float = 1.0  # as the site registered it; prior_capacity_tok_s is in its time
    agent_ceiling_tok_s: float = 0.0  # what its agent can relay, while at its CPU ceiling (0: not)
    outstanding_by_tier: tuple[int, ...] = ()  # of outstanding_requests, how many of each tier (Tier's order)


@dataclass(frozen=True, slots=True)
class FederationState:
    sites: tuple[SiteState, ...]
    model: str
    refused: tuple[RefusedSite, ...] = ()
    built_unix_s: float = 0.0  # when the replica built it (its wall clock; 0: not said)


@dataclass(frozen=True, slots=True)
class RefusedSite:
    """A site that asked to join and was refused, and why."""

    name: str
    reason: str
    at_unix_s: float


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_tokens: int
    sampling_params: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    input_ids: tuple[int, ...] = ()
    every_event: bool = False  # relay each worker event as its own delta, at once (see the proto)
    logprobs: bool = False  # each output token's log probability, asked for
    top_logprobs: int = 0  # and this many most likely tokens at each position
    traceparent: str = ""  # the gateway's attempt span, W3C trace context ("": not traced; see the proto)
    resumed_tokens: int = 0  # of the prompt, what a resumed answer said before (see the proto)
    prefix_hashes: tuple[int, ...] = ()  # the prompt's block hashes (core/prefixes.py)
    tier: Tier = Tier.DEFAULT  # the request's service tier (core/tiers.py)


@dataclass(frozen=True, slots=True)
class GenerateCommand:
    """What a gateway asks of an agent on its Generate call: generations to start (each with the
    caller's number for it on this call) and to cancel."""

    starts: tuple[tuple[int, GenerateRequest], ...] = ()
    cancels: tuple[int, ...] = ()
    refused: tuple[tuple[int, str], ...] = ()  # starts that could not be read, and why


class StreamError(enum.Enum):
    NONE = pb.STREAM_ERROR_NONE
    REJECTED = pb.STREAM_ERROR_REJECTED
    WORKER_FAILED = pb.STREAM_ERROR_WORKER_FAILED
    SITE_FAILED = pb.STREAM_ERROR_SITE_FAILED


class TokenDelta(NamedTuple):
    """What one generation produced since its previous delta (see the proto). A NamedTuple, not a
    dataclass like the others: one is built per stream per batch at each end, and a tuple is
    built in a quarter of the time."""

    stream: int
    text: str
    output_ids: tuple[int, ...]
    completion_tokens: int
    prompt_tokens: int
    finish_reason: dict[str, Any] | None = None
    worker: str = ""
    accepted_unix_s: float = 0.0
    error: StreamError = StreamError.NONE
    error_message: str = ""
    logprobs: tuple[float, ...] = ()  # asked for: one per output id
    top: tuple[tuple[tuple[int, float], ...], ...] = ()  # and at each position the most likely (id, logprob)
    cached_tokens: int = 0  # of the prompt, found in the worker's prefix cache (on a stream's first and last)


class TokenFlow(NamedTuple):
    """The middle of answers in columns (the proto's TokenFlow), filled by the agent's relay a
    delta at a time: each delta's stream, text, id count and completion tokens so far, and all
    their ids in one column. Appending to five lists costs a fraction of a TokenDelta."""

    streams: list[int]
    texts: list[str]
    id_counts: list[int]
    ids: list[int]
    completion_tokens: list[int]

    @classmethod
    def empty(cls) -> TokenFlow:
        return cls([], [], [], [], [])


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """`fedctl site add --agent`: the schedulers an agent started without them is to join, and
    the site the operator means it to be."""

    schedulers: tuple[str, ...]
    site: str
    region: str
    gpu: str
    gpus: int


def _plain(dc: Any) -> dict[str, Any]:
    return {f.name: getattr(dc, f.name) for f in fields(dc)}


# ---- to protobuf ----------------------------------------------------------------------


def registration_to_pb(r: SiteRegistration) -> pb.SiteRegistration:
    return pb.SiteRegistration(**_plain(r))


def registered_to_pb(r: Registered) -> pb.Registered:
    return pb.Registered(**_plain(r))


def report_to_pb(r: SiteReport) -> pb.SiteReport:
    return pb.SiteReport(**{**_plain(r), "work": pb.WorkDone(**_plain(r.work))})


def report_refreshed_pb(
    read: pb.SiteReport, queued: int, outstanding_requests: int, outstanding_tokens: int, received_ids: Sequence[str]
) -> pb.SiteReport:
    """`read` (a report built when the workers were last read) with the load held now and the
    requests taken since the last report: for a reporter that reports more often than it reads."""
    report = pb.SiteReport()
    report.CopyFrom(read)
    report.queued_requests = queued
    report.outstanding_requests = outstanding_requests
    report.outstanding_tokens = outstanding_tokens
    report.received_ids.extend(received_ids)
    return report


def command_to_pb(c: SchedulerCommand) -> pb.SchedulerCommand:
    return pb.SchedulerCommand(command=c.command.value, reason=c.reason, report_interval_s=c.report_interval_s)


# Service tiers on the wire: the default tier is the proto's 0, what a peer that sends none means.
_TIER_TO_PB: dict[Tier, pb.ServiceTier] = {
    Tier.DEFAULT: pb.SERVICE_TIER_DEFAULT,
    Tier.PRIORITY: pb.SERVICE_TIER_PRIORITY,
    Tier.FLEX: pb.SERVICE_TIER_FLEX,
}
_TIER_FROM_PB: dict[int, Tier] = {value: tier for tier, value in _TIER_TO_PB.items()}


def _tier_from_pb(value: int) -> Tier:
    """A tier this build does not know (a newer peer's) is the default one."""
    return _TIER_FROM_PB.get(value, Tier.DEFAULT)


def route_request_to_pb(r: RouteRequest) -> pb.RouteRequest:
    return pb.RouteRequest(**{**_plain(r), "tier": _TIER_TO_PB[r.tier]})


def decision_to_pb(d: RouteDecision) -> pb.RouteDecision:
    return pb.RouteDecision(**_plain(d))


def route_calls_to_pb(calls: Sequence[RouteCall]) -> pb.RouteCalls:
    return pb.RouteCalls(
        calls=[
            pb.RouteCall(number=c.number, request=route_request_to_pb(c.request), trace_context=dict(c.trace_context))
            for c in calls
        ]
    )


def route_answers_to_pb(answers: Sequence[RouteAnswer]) -> pb.RouteAnswers:
    return pb.RouteAnswers(
        answers=[
            pb.RouteAnswer(number=a.number, code=a.code, message=a.message)
            if a.decision is None
            else pb.RouteAnswer(number=a.number, decision=decision_to_pb(a.decision))
            for a in answers
        ]
    )


def site_state_to_pb(s: SiteState) -> pb.SiteState:
    return pb.SiteState(**{**_plain(s), "status": s.status.value})


def federation_state_to_pb(s: FederationState) -> pb.FederationState:
    return federation_state_pb([site_state_to_pb(x) for x in s.sites], s.model, s.refused, s.built_unix_s)


def site_state_pb_now(
    m: pb.SiteState, outstanding: tuple[int, int, int], by_tier: Sequence[int], ages: tuple[float, float, float]
) -> pb.SiteState:
    """`m`, a site's state built earlier, with its (outstanding requests, outstanding tokens,
    routed requests), its outstanding requests by tier and its (report, status, workers) ages
    of now: what changes between its reports."""
    m.outstanding_requests, m.outstanding_tokens, m.routed_requests = outstanding
    del m.outstanding_by_tier[:]
    m.outstanding_by_tier.extend(by_tier)
    m.last_report_age_s, m.status_age_s, m.workers_age_s = ages
    return m


def federation_state_pb(
    sites: Sequence[pb.SiteState], model: str, refused: Sequence[RefusedSite], built_unix_s: float
) -> pb.FederationState:
    return pb.FederationState(
        sites=sites, model=model, refused=[pb.RefusedSite(**_plain(r)) for r in refused], built_unix_s=built_unix_s
    )


def _generate_request_to_pb(stream: int, r: GenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=r.request_id,
        text=r.text,
        input_ids=r.input_ids,
        sampling_params_json=json.dumps(r.sampling_params),
        prompt_tokens=r.prompt_tokens,
        stream=stream,
        every_event=r.every_event,
        logprobs=r.logprobs,
        top_logprobs=r.top_logprobs,
        traceparent=r.traceparent,
        resumed_tokens=r.resumed_tokens,
        prefix_hashes=r.prefix_hashes,
        tier=_TIER_TO_PB[r.tier],
    )


def generate_command_to_pb(starts: Sequence[tuple[int, GenerateRequest]], cancels: Sequence[int]) -> pb.GenerateCommand:
    return pb.GenerateCommand(start=[_generate_request_to_pb(n, r) for n, r in starts], cancel=cancels)


def token_batch_to_pb(deltas: Sequence[TokenDelta], flow: TokenFlow | None = None) -> pb.TokenBatch:
    """At the token rate: `deltas` as TokenDelta messages (a stream's first, its last, a failure,
    logprobs), their fields set only when not at their defaults; `flow`, the middle of answers
    (only a gateway that reads TokenFlow is sent any), as the batch's columns."""
    batch = pb.TokenBatch()
    add = batch.deltas.add
    for d in deltas:
        m = add(
            stream=d.stream,
            text=d.text,
            output_ids=d.output_ids,
            completion_tokens=d.completion_tokens,
            prompt_tokens=d.prompt_tokens,
            cached_tokens=d.cached_tokens,
        )
        if d.finish_reason is not None:
            m.finish_reason_json = json.dumps(d.finish_reason)
        if d.worker:
            m.worker, m.accepted_unix_s = d.worker, d.accepted_unix_s
        if d.error is not StreamError.NONE:
            m.error, m.error_message = d.error.value, d.error_message
        if d.logprobs:
            m.logprobs.extend(d.logprobs)
            for position in d.top:
                m.top_ids.extend(i for i, _ in position)
                m.top_logprobs.extend(lp for _, lp in position)
    if flow is not None and flow.streams:
        batch.flow.streams.extend(flow.streams)
        batch.flow.texts.extend(flow.texts)
        batch.flow.id_counts.extend(flow.id_counts)
        batch.flow.ids.extend(flow.ids)
        batch.flow.completion_tokens.extend(flow.completion_tokens)
    return batch


def state_request_to_pb(interval_s: float = 0.0) -> pb.StateRequest:
    return pb.StateRequest(interval_s=interval_s)


def join_request_to_pb(r: JoinRequest) -> pb.JoinRequest:
    return pb.JoinRequest(**_plain(r))


def join_reply_to_pb(site: str, agent_address: str) -> pb.JoinReply:
    return pb.JoinReply(site=site, agent_address=agent_address)


# ---- from protobuf ----------------------------------------------------------------------


def registration_from_pb(m: pb.SiteRegistration) -> SiteRegistration:
    return SiteRegistration(**{f.name: getattr(m, f.name) for f in fields(SiteRegistration)})


def registered_from_pb(m: pb.Registered) -> Registered:
    return Registered(m.site, m.prior_capacity_tok_s, m.report_interval_s)


def report_from_pb(m: pb.SiteReport) -> SiteReport:
    values = {f.name: getattr(m, f.name) for f in fields(SiteReport)}
    work = WorkDone(**{f.name: getattr(m.work, f.name) for f in fields(WorkDone)})
    by_tier = tuple(m.outstanding_by_tier[: len(Tier)])
    return SiteReport(**{**values, "received_ids": tuple(m.received_ids), "work": work, "outstanding_by_tier": by_tier})


def command_from_pb(m: pb.SchedulerCommand) -> SchedulerCommand:
    return SchedulerCommand(Command(m.command), m.reason, m.report_interval_s)


def route_request_from_pb(m: pb.RouteRequest) -> RouteRequest:
    return RouteRequest(
        m.request_id,
        m.prompt_tokens,
        m.max_tokens,
        m.client_region,
        tuple(m.exclude_sites),
        m.dry_run,
        tuple(m.prefix_hashes[: prefixes.MAX_BLOCKS]),
        _tier_from_pb(m.tier),
        m.max_delay_s,
    )


def decision_from_pb(m: pb.RouteDecision) -> RouteDecision:
    return RouteDecision(m.site, m.agent_address, m.expected_delay_s, m.reason)


def route_calls_from_pb(m: pb.RouteCalls) -> list[RouteCall]:
    return [RouteCall(c.number, route_request_from_pb(c.request), tuple(c.trace_context.items())) for c in m.calls]


def route_answers_from_pb(m: pb.RouteAnswers) -> list[RouteAnswer]:
    return [
        RouteAnswer(a.number, decision_from_pb(a.decision) if a.HasField("decision") else None, a.code, a.message)
        for a in m.answers
    ]


def site_state_from_pb(m: pb.SiteState) -> SiteState:
    values = {f.name: getattr(m, f.name) for f in fields(SiteState)}
    by_tier = tuple(m.outstanding_by_tier[: len(Tier)])
    return SiteState(**{**values, "status": SiteStatus(m.status), "outstanding_by_tier": by_tier})


def federation_state_from_pb(m: pb.FederationState) -> FederationState:
    refused = tuple(RefusedSite(r.name, r.reason, r.at_unix_s) for r in m.refused)
    return FederationState(tuple(site_state_from_pb(s) for s in m.sites), m.model, refused, m.built_unix_s)


def generate_command_from_pb(m: pb.GenerateCommand) -> GenerateCommand:
    """A start whose sampling_params_json is not a JSON object, or whose request id is not one,
    is `refused`, not raised: the other starts of the same message go on."""
    starts, refused = [], []
    for r in m.start:
        try:
            params = json.loads(r.sampling_params_json) if r.sampling_params_json else {}
        except ValueError:
            params = None
        if not isinstance(params, dict):
            refused.append((r.stream, "sampling_params_json must be a JSON object"))
            continue
        if not REQUEST_ID.match(r.request_id):
            refused.append((r.stream, f"request_id must match {REQUEST_ID.pattern}"))
            continue
        request = GenerateRequest(
            r.request_id,
            r.prompt_tokens,
            params,
            r.text,
            tuple(r.input_ids),
            r.every_event,
            r.logprobs,
            r.top_logprobs,
            r.traceparent,
            r.resumed_tokens,
            tuple(r.prefix_hashes[: prefixes.MAX_BLOCKS]),
            _tier_from_pb(r.tier),
        )
        starts.append((r.stream, request))
    return GenerateCommand(tuple(starts), tuple(m.cancel), tuple(refused))


_STREAM_ERRORS = {e.value: e for e in StreamError}

# A gateway that reads TokenBatch.flow says so in its Generate call's metadata.
TOKEN_FLOW_METADATA = ("federation-token-flow", "1")


def token_batch_from_pb(m: pb.TokenBatch) -> list[TokenDelta]:
    """Every delta of the batch as a TokenDelta: its messages', then its columns'. (The gateway
    reads the columns apart, `token_flow_from_pb`, and builds no TokenDelta for them.) Raises
    ValueError for columns that do not match."""
    out = token_deltas_from_pb(m)
    if m.HasField("flow"):
        new = tuple.__new__  # a tuple's own constructor: half the NamedTuple's cost
        for stream, text, ids, completion in zip(*token_flow_from_pb(m.flow), strict=True):
            out.append(new(TokenDelta, (stream, text, ids, completion, *_FLOW_DEFAULTS)))
    return out


def token_deltas_from_pb(m: pb.TokenBatch) -> list[TokenDelta]:
    """The batch's TokenDelta messages (a stream's first, its last, a failure, logprobs). An error
    kind this gateway does not know (a newer agent's) is a site failure all the same."""
    return [
        TokenDelta(
            d.stream,
            d.text,
            tuple(d.output_ids),
            d.completion_tokens,
            d.prompt_tokens,
            json.loads(d.finish_reason_json) if d.finish_reason_json else None,
            d.worker,
            d.accepted_unix_s,
            _STREAM_ERRORS.get(d.error, StreamError.SITE_FAILED),
            d.error_message,
            tuple(d.logprobs) if d.logprobs else (),
            _top(d) if d.top_ids else (),
            d.cached_tokens,
        )
        for d in m.deltas
    ]


def token_flow_from_pb(f: pb.TokenFlow) -> tuple[list[int], list[str], list[tuple[int, ...]], list[int]]:
    """The middle of answers, as its columns: streams, texts, each delta's ids (its slice of the
    one ids column), completion tokens so far; each column read at once, not a field at a time
    (this runs at the token rate). Raises ValueError for columns that do not match."""
    streams, texts, counts, completions = list(f.streams), list(f.texts), list(f.id_counts), list(f.completion_tokens)
    ids = tuple(f.ids)
    if not len(streams) == len(texts) == len(counts) == len(completions) or sum(counts) != len(ids):
        raise ValueError("a TokenFlow whose columns do not match")
    bounds = itertools.pairwise(itertools.accumulate(counts, initial=0))
    return streams, texts, [ids[start:end] for start, end in bounds], completions


# A flow delta's fields after its completion_tokens: prompt_tokens and the rest at their defaults.
_FLOW_DEFAULTS = (0, None, "", 0.0, StreamError.NONE, "", (), (), 0)


def _top(d: pb.TokenDelta) -> tuple[tuple[tuple[int, float], ...], ...]:
    """The flat top_ids / top_logprobs, cut into one tuple of pairs per output position."""
    per = len(d.top_ids) // max(1, len(d.logprobs))
    pairs = list(zip(d.top_ids, d.top_logprobs, strict=False))
    return tuple(tuple(pairs[i : i + per]) for i in range(0, len(pairs), per or 1))


def site_ref_from_pb(m: pb.SiteRef) -> str:
    return m.site


def site_ref_to_pb(site: str) -> pb.SiteRef:
    return pb.SiteRef(site=site)


def state_request_from_pb(m: pb.StateRequest) -> float:
    return m.interval_s


def join_request_from_pb(m: pb.JoinRequest) -> JoinRequest:
    return JoinRequest(tuple(m.schedulers), m.site, m.region, m.gpu, m.gpus)
