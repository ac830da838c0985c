from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SiteStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SITE_STATUS_UNSPECIFIED: _ClassVar[SiteStatus]
    SITE_STATUS_JOINING: _ClassVar[SiteStatus]
    SITE_STATUS_READY: _ClassVar[SiteStatus]
    SITE_STATUS_DRAINING: _ClassVar[SiteStatus]
    SITE_STATUS_DOWN: _ClassVar[SiteStatus]

class Command(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_UNSPECIFIED: _ClassVar[Command]
    COMMAND_DRAIN: _ClassVar[Command]
    COMMAND_UNDRAIN: _ClassVar[Command]
    COMMAND_REMOVE: _ClassVar[Command]
    COMMAND_REPORT_EVERY: _ClassVar[Command]

class ServiceTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_TIER_DEFAULT: _ClassVar[ServiceTier]
    SERVICE_TIER_PRIORITY: _ClassVar[ServiceTier]
    SERVICE_TIER_FLEX: _ClassVar[ServiceTier]

class StreamError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_ERROR_NONE: _ClassVar[StreamError]
    STREAM_ERROR_REJECTED: _ClassVar[StreamError]
    STREAM_ERROR_WORKER_FAILED: _ClassVar[StreamError]
    STREAM_ERROR_SITE_FAILED: _ClassVar[StreamError]
SITE_STATUS_UNSPECIFIED: SiteStatus
SITE_STATUS_JOINING: SiteStatus
SITE_STATUS_READY: SiteStatus
SITE_STATUS_DRAINING: SiteStatus
SITE_STATUS_DOWN: SiteStatus
COMMAND_UNSPECIFIED: Command
COMMAND_DRAIN: Command
COMMAND_UNDRAIN: Command
COMMAND_REMOVE: Command
COMMAND_REPORT_EVERY: Command
SERVICE_TIER_DEFAULT: ServiceTier
SERVICE_TIER_PRIORITY: ServiceTier
SERVICE_TIER_FLEX: ServiceTier
STREAM_ERROR_NONE: StreamError
STREAM_ERROR_REJECTED: StreamError
STREAM_ERROR_WORKER_FAILED: StreamError
STREAM_ERROR_SITE_FAILED: StreamError

class SiteRegistration(_message.Message):
    __slots__ = ("name", "region", "gpu", "gpus", "agent_address", "model", "probe_batch", "probe_context_tokens", "probe_tok_s", "tokenizer", "draining", "checkpoint", "weight_format", "clock_speed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROBE_BATCH_FIELD_NUMBER: _ClassVar[int]
    PROBE_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBE_TOK_S_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SPEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    region: str
    gpu: str
    gpus: int
    agent_address: str
    model: str
    probe_batch: float
    probe_context_tokens: float
    probe_tok_s: float
    tokenizer: str
    draining: bool
    checkpoint: str
    weight_format: str
    clock_speed: float
    def __init__(self, name: _Optional[str] = ..., region: _Optional[str] = ..., gpu: _Optional[str] = ..., gpus: _Optional[int] = ..., agent_address: _Optional[str] = ..., model: _Optional[str] = ..., probe_batch: _Optional[float] = ..., probe_context_tokens: _Optional[float] = ..., probe_tok_s: _Optional[float] = ..., tokenizer: _Optional[str] = ..., draining: _Optional[bool] = ..., checkpoint: _Optional[str] = ..., weight_format: _Optional[str] = ..., clock_speed: _Optional[float] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("site", "prior_capacity_tok_s", "report_interval_s")
    SITE_FIELD_NUMBER: _ClassVar[int]
    PRIOR_CAPACITY_TOK_S_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    site: str
    prior_capacity_tok_s: float
    report_interval_s: float
    def __init__(self, site: _Optional[str] = ..., prior_capacity_tok_s: _Optional[float] = ..., report_interval_s: _Optional[float] = ...) -> None: ...

class SiteReport(_message.Message):
    __slots__ = ("site", "healthy_workers", "total_workers", "running_requests", "queued_requests", "kv_usage", "gen_throughput_tok_s", "outstanding_requests", "outstanding_tokens", "slots", "context_tokens", "received_ids", "prompt_tokens_total", "generation_tokens_total", "delivered_tok_s", "loading_workers", "work", "accounting_workers", "loop_cpu_s", "relayed_tokens_total", "outstanding_by_tier")
    SITE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    GEN_THROUGHPUT_TOK_S_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_TOK_S_FIELD_NUMBER: _ClassVar[int]
    LOADING_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTING_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LOOP_CPU_S_FIELD_NUMBER: _ClassVar[int]
    RELAYED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    site: str
    healthy_workers: int
    total_workers: int
    running_requests: int
    queued_requests: int
    kv_usage: float
    gen_throughput_tok_s: float
    outstanding_requests: int
    outstanding_tokens: int
    slots: int
    context_tokens: int
    received_ids: _containers.RepeatedScalarFieldContainer[str]
    prompt_tokens_total: int
    generation_tokens_total: int
    delivered_tok_s: float
    loading_workers: int
    work: WorkDone
    accounting_workers: int
    loop_cpu_s: float
    relayed_tokens_total: int
    outstanding_by_tier: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, site: _Optional[str] = ..., healthy_workers: _Optional[int] = ..., total_workers: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., kv_usage: _Optional[float] = ..., gen_throughput_tok_s: _Optional[float] = ..., outstanding_requests: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., slots: _Optional[int] = ..., context_tokens: _Optional[int] = ..., received_ids: _Optional[_Iterable[str]] = ..., prompt_tokens_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., delivered_tok_s: _Optional[float] = ..., loading_workers: _Optional[int] = ..., work: _Optional[_Union[WorkDone, _Mapping]] = ..., accounting_workers: _Optional[int] = ..., loop_cpu_s: _Optional[float] = ..., relayed_tokens_total: _Optional[int] = ..., outstanding_by_tier: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkDone(_message.Message):
    __slots__ = ("busy_s", "passes", "decode_seqs", "context_ktokens", "prefill_tokens", "cached_tokens")
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_KTOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    busy_s: float
    passes: int
    decode_seqs: float
    context_ktokens: float
    prefill_tokens: int
    cached_tokens: int
    def __init__(self, busy_s: _Optional[float] = ..., passes: _Optional[int] = ..., decode_seqs: _Optional[float] = ..., context_ktokens: _Optional[float] = ..., prefill_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SchedulerCommand(_message.Message):
    __slots__ = ("command", "reason", "report_interval_s")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    command: Command
    reason: str
    report_interval_s: float
    def __init__(self, command: _Optional[_Union[Command, str]] = ..., reason: _Optional[str] = ..., report_interval_s: _Optional[float] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "client_region", "prompt_tokens", "max_tokens", "exclude_sites", "dry_run", "prefix_hashes", "tier", "max_delay_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REGION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_SITES_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MAX_DELAY_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    client_region: str
    prompt_tokens: int
    max_tokens: int
    exclude_sites: _containers.RepeatedScalarFieldContainer[str]
    dry_run: bool
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: ServiceTier
    max_delay_s: float
    def __init__(self, request_id: _Optional[str] = ..., client_region: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., exclude_sites: _Optional[_Iterable[str]] = ..., dry_run: _Optional[bool] = ..., prefix_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[ServiceTier, str]] = ..., max_delay_s: _Optional[float] = ...) -> None: ...

class RouteDecision(_message.Message):
    __slots__ = ("site", "agent_address", "expected_delay_s", "reason")
    SITE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DELAY_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    site: str
    agent_address: str
    expected_delay_s: float
    reason: str
    def __init__(self, site: _Optional[str] = ..., agent_address: _Optional[str] = ..., expected_delay_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class RouteCall(_message.Message):
    __slots__ = ("number", "request", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    number: int
    request: RouteRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, number: _Optional[int] = ..., request: _Optional[_Union[RouteRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RouteCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[RouteCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[RouteCall, _Mapping]]] = ...) -> None: ...

class RouteAnswer(_message.Message):
    __slots__ = ("number", "decision", "code", "message")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    number: int
    decision: RouteDecision
    code: int
    message: str
    def __init__(self, number: _Optional[int] = ..., decision: _Optional[_Union[RouteDecision, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RouteAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[RouteAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[RouteAnswer, _Mapping]]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class SiteState(_message.Message):
    __slots__ = ("name", "region", "gpu", "gpus", "agent_address", "status", "capacity_tok_s", "outstanding_requests", "outstanding_tokens", "routed_requests", "healthy_workers", "total_workers", "last_report_age_s", "prior_capacity_tok_s", "capacity_evidence", "queued_requests", "slots", "admit_window", "prefill_s_per_token", "status_age_s", "workers_age_s", "checkpoint", "weight_format", "loading_workers", "running_requests", "kv_usage", "gen_throughput_tok_s", "context_tokens", "clock_speed", "agent_ceiling_tok_s", "outstanding_by_tier")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOK_S_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PRIOR_CAPACITY_TOK_S_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATUS_AGE_S_FIELD_NUMBER: _ClassVar[int]
    WORKERS_AGE_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LOADING_WORKERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    GEN_THROUGHPUT_TOK_S_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SPEED_FIELD_NUMBER: _ClassVar[int]
    AGENT_CEILING_TOK_S_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_BY_TIER_FIELD_NUMBER: _ClassVar[int]
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
    prior_capacity_tok_s: float
    capacity_evidence: str
    queued_requests: int
    slots: int
    admit_window: int
    prefill_s_per_token: float
    status_age_s: float
    workers_age_s: float
    checkpoint: str
    weight_format: str
    loading_workers: int
    running_requests: int
    kv_usage: float
    gen_throughput_tok_s: float
    context_tokens: int
    clock_speed: float
    agent_ceiling_tok_s: float
    outstanding_by_tier: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., region: _Optional[str] = ..., gpu: _Optional[str] = ..., gpus: _Optional[int] = ..., agent_address: _Optional[str] = ..., status: _Optional[_Union[SiteStatus, str]] = ..., capacity_tok_s: _Optional[float] = ..., outstanding_requests: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., routed_requests: _Optional[int] = ..., healthy_workers: _Optional[int] = ..., total_workers: _Optional[int] = ..., last_report_age_s: _Optional[float] = ..., prior_capacity_tok_s: _Optional[float] = ..., capacity_evidence: _Optional[str] = ..., queued_requests: _Optional[int] = ..., slots: _Optional[int] = ..., admit_window: _Optional[int] = ..., prefill_s_per_token: _Optional[float] = ..., status_age_s: _Optional[float] = ..., workers_age_s: _Optional[float] = ..., checkpoint: _Optional[str] = ..., weight_format: _Optional[str] = ..., loading_workers: _Optional[int] = ..., running_requests: _Optional[int] = ..., kv_usage: _Optional[float] = ..., gen_throughput_tok_s: _Optional[float] = ..., context_tokens: _Optional[int] = ..., clock_speed: _Optional[float] = ..., agent_ceiling_tok_s: _Optional[float] = ..., outstanding_by_tier: _Optional[_Iterable[int]] = ...) -> None: ...

class FederationState(_message.Message):
    __slots__ = ("sites", "model", "refused", "built_unix_s")
    SITES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    BUILT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    sites: _containers.RepeatedCompositeFieldContainer[SiteState]
    model: str
    refused: _containers.RepeatedCompositeFieldContainer[RefusedSite]
    built_unix_s: float
    def __init__(self, sites: _Optional[_Iterable[_Union[SiteState, _Mapping]]] = ..., model: _Optional[str] = ..., refused: _Optional[_Iterable[_Union[RefusedSite, _Mapping]]] = ..., built_unix_s: _Optional[float] = ...) -> None: ...

class RefusedSite(_message.Message):
    __slots__ = ("name", "reason", "at_unix_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    at_unix_s: float
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ..., at_unix_s: _Optional[float] = ...) -> None: ...

class SiteRef(_message.Message):
    __slots__ = ("site",)
    SITE_FIELD_NUMBER: _ClassVar[int]
    site: str
    def __init__(self, site: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "input_ids", "sampling_params_json", "prompt_tokens", "stream", "every_event", "logprobs", "top_logprobs", "traceparent", "resumed_tokens", "prefix_hashes", "tier")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    EVERY_EVENT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params_json: str
    prompt_tokens: int
    stream: int
    every_event: bool
    logprobs: bool
    top_logprobs: int
    traceparent: str
    resumed_tokens: int
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: ServiceTier
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling_params_json: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., stream: _Optional[int] = ..., every_event: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., traceparent: _Optional[str] = ..., resumed_tokens: _Optional[int] = ..., prefix_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[ServiceTier, str]] = ...) -> None: ...

class GenerateCommand(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("stream", "text", "output_ids", "completion_tokens", "prompt_tokens", "finish_reason_json", "worker", "accepted_unix_s", "error", "error_message", "logprobs", "top_ids", "top_logprobs", "cached_tokens")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_JSON_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    stream: int
    text: str
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_tokens: int
    prompt_tokens: int
    finish_reason_json: str
    worker: str
    accepted_unix_s: float
    error: StreamError
    error_message: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    cached_tokens: int
    def __init__(self, stream: _Optional[int] = ..., text: _Optional[str] = ..., output_ids: _Optional[_Iterable[int]] = ..., completion_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., finish_reason_json: _Optional[str] = ..., worker: _Optional[str] = ..., accepted_unix_s: _Optional[float] = ..., error: _Optional[_Union[StreamError, str]] = ..., error_message: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("deltas", "flow")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    flow: TokenFlow
    def __init__(self, deltas: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ..., flow: _Optional[_Union[TokenFlow, _Mapping]] = ...) -> None: ...

class TokenFlow(_message.Message):
    __slots__ = ("streams", "texts", "id_counts", "ids", "completion_tokens")
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    ID_COUNTS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    streams: _containers.RepeatedScalarFieldContainer[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    id_counts: _containers.RepeatedScalarFieldContainer[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    completion_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, streams: _Optional[_Iterable[int]] = ..., texts: _Optional[_Iterable[str]] = ..., id_counts: _Optional[_Iterable[int]] = ..., ids: _Optional[_Iterable[int]] = ..., completion_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("schedulers", "site", "region", "gpu", "gpus")
    SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    schedulers: _containers.RepeatedScalarFieldContainer[str]
    site: str
    region: str
    gpu: str
    gpus: int
    def __init__(self, schedulers: _Optional[_Iterable[str]] = ..., site: _Optional[str] = ..., region: _Optional[str] = ..., gpu: _Optional[str] = ..., gpus: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("site", "agent_address")
    SITE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    site: str
    agent_address: str
    def __init__(self, site: _Optional[str] = ..., agent_address: _Optional[str] = ...) -> None: ...
