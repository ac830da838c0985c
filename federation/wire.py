"""proto <-> domain dataclasses: the one module that touches generated protobuf code.

Servicers and clients receive pb2 messages from grpc; they call `from_pb` at once and
`to_pb` at the last moment, so the policy, registry and ledger only ever see the
frozen dataclasses below.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields
from typing import Any

from proto import federation_pb2 as pb
from proto import federation_pb2_grpc as pb_grpc

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


@dataclass(frozen=True, slots=True)
class Registered:
    site: str
    prior_capacity_tok_s: float
    report_interval_s: float


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
    prompt_tokens_total: int = 0  # of the requests the workers finished since the agent started
    generation_tokens_total: int = 0
    delivered_tok_s: float = 0.0  # output tokens/s the agent relayed, over recent seconds


@dataclass(frozen=True, slots=True)
class SchedulerCommand:
    command: Command
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int = 0  # 0: not given
    client_region: str = ""
    exclude_sites: tuple[str, ...] = ()
    dry_run: bool = False  # decide, but do not count the route


@dataclass(frozen=True, slots=True)
class RouteDecision:
    site: str
    agent_address: str
    expected_delay_s: float
    reason: str


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


@dataclass(frozen=True, slots=True)
class FederationState:
    sites: tuple[SiteState, ...]
    model: str
    refused: tuple[RefusedSite, ...] = ()


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


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    text: str
    output_ids: tuple[int, ...]
    completion_tokens: int
    prompt_tokens: int
    finish_reason: dict[str, Any] | None = None
    site: str = ""
    worker: str = ""


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
    return pb.SiteReport(**_plain(r))


def command_to_pb(c: SchedulerCommand) -> pb.SchedulerCommand:
    return pb.SchedulerCommand(command=c.command.value, reason=c.reason)


def route_request_to_pb(r: RouteRequest) -> pb.RouteRequest:
    return pb.RouteRequest(**_plain(r))


def decision_to_pb(d: RouteDecision) -> pb.RouteDecision:
    return pb.RouteDecision(**_plain(d))


def site_state_to_pb(s: SiteState) -> pb.SiteState:
    return pb.SiteState(**{**_plain(s), "status": s.status.value})


def federation_state_to_pb(s: FederationState) -> pb.FederationState:
    refused = [pb.RefusedSite(**_plain(r)) for r in s.refused]
    return pb.FederationState(sites=[site_state_to_pb(x) for x in s.sites], model=s.model, refused=refused)


def generate_request_to_pb(r: GenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=r.request_id,
        text=r.text,
        input_ids=r.input_ids,
        sampling_params_json=json.dumps(r.sampling_params),
        prompt_tokens=r.prompt_tokens,
    )


def chunk_to_pb(c: GenerateChunk) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        text=c.text,
        output_ids=c.output_ids,
        completion_tokens=c.completion_tokens,
        prompt_tokens=c.prompt_tokens,
        finish_reason_json=json.dumps(c.finish_reason) if c.finish_reason is not None else "",
        site=c.site,
        worker=c.worker,
    )


def state_request_to_pb(interval_s: float = 0.0) -> pb.StateRequest:
    return pb.StateRequest(interval_s=interval_s)


def abort_reply_to_pb(found: bool) -> pb.AbortReply:
    return pb.AbortReply(found=found)


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
    return SiteReport(**{**values, "received_ids": tuple(m.received_ids)})


def command_from_pb(m: pb.SchedulerCommand) -> SchedulerCommand:
    return SchedulerCommand(Command(m.command), m.reason)


def route_request_from_pb(m: pb.RouteRequest) -> RouteRequest:
    return RouteRequest(m.request_id, m.prompt_tokens, m.max_tokens, m.client_region, tuple(m.exclude_sites), m.dry_run)


def decision_from_pb(m: pb.RouteDecision) -> RouteDecision:
    return RouteDecision(m.site, m.agent_address, m.expected_delay_s, m.reason)


def site_state_from_pb(m: pb.SiteState) -> SiteState:
    values = {f.name: getattr(m, f.name) for f in fields(SiteState)}
    return SiteState(**{**values, "status": SiteStatus(m.status)})


def federation_state_from_pb(m: pb.FederationState) -> FederationState:
    refused = tuple(RefusedSite(r.name, r.reason, r.at_unix_s) for r in m.refused)
    return FederationState(tuple(site_state_from_pb(s) for s in m.sites), m.model, refused)


def generate_request_from_pb(m: pb.GenerateRequest) -> GenerateRequest:
    """Raises ValueError when sampling_params_json is not a JSON object."""
    params = json.loads(m.sampling_params_json) if m.sampling_params_json else {}
    if not isinstance(params, dict):
        raise ValueError("sampling_params_json must be a JSON object")
    return GenerateRequest(m.request_id, m.prompt_tokens, params, m.text, tuple(m.input_ids))


def chunk_from_pb(m: pb.GenerateChunk) -> GenerateChunk:
    finish = json.loads(m.finish_reason_json) if m.finish_reason_json else None
    return GenerateChunk(m.text, tuple(m.output_ids), m.completion_tokens, m.prompt_tokens, finish, m.site, m.worker)


def site_ref_from_pb(m: pb.SiteRef) -> str:
    return m.site


def site_ref_to_pb(site: str) -> pb.SiteRef:
    return pb.SiteRef(site=site)


def state_request_from_pb(m: pb.StateRequest) -> float:
    return m.interval_s


def abort_request_from_pb(m: pb.AbortRequest) -> str:
    return m.request_id


def join_request_from_pb(m: pb.JoinRequest) -> JoinRequest:
    return JoinRequest(tuple(m.schedulers), m.site, m.region, m.gpu, m.gpus)
