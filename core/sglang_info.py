"""SGLang's native information shapes (0.5.23): `/model_info`, `/server_info`, `/v1/loads`.

What SGLang's own tools (its router, `bench_serving`, the model gateway) read from a server,
as small frozen dataclasses with SGLang's field names, types and defaults, turned into the
JSON bodies SGLang answers with. A server that is not SGLang (the federation's gateway) fills
them with its own values and so answers in SGLang's keys and types; what it adds of its own
goes beside them (`extra`), never in their place. The query of `/v1/loads` is read here too,
with SGLang's sections, refusing what SGLang would refuse and what it would silently ignore.

Read from SGLang's source (`entrypoints/http_server.py`, `entrypoints/v1_loads.py`,
`managers/io_struct.py`): `/server_info` is the flattened `ServerArgs`, then the scheduler's
info (`status`, `max_total_num_tokens`, `max_req_input_len`), then `internal_states` (one per
DP rank) and `version`; `/v1/loads` is `{timestamp (ISO 8601, UTC), version, accelerator,
num_accelerators, loads: [one per DP rank]}`, each load's core section always there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.errors import BadRequest

SGLANG_VERSION = "0.5.23"  # the SGLang whose shapes these are
MODEL_TYPE = "gpt_oss"  # GPT-OSS's Hugging Face config: model_type, architectures
ARCHITECTURES = ("GptOssForCausalLM",)
# SGLang reserves a few tokens of the context for the answer's start: max_req_input_len is
# min(context - 1, KV pool - 1) less this.
INPUT_LEN_RESERVE_TOKENS = 5


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """The part of SGLang's `ServerArgs` its tools read, flattened into `/server_info` as SGLang
    does (its names, its defaults)."""

    model_path: str
    served_model_name: str
    tokenizer_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    context_length: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    schedule_policy: str = "fcfs"
    stream_interval: int = 1
    incremental_streaming_output: bool = False
    skip_tokenizer_init: bool = False
    enable_metrics: bool = False
    enable_dp_attention: bool = False
    quantization: str | None = None
    load_format: str = "auto"
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    disaggregation_mode: str = "null"
    weight_version: str = "default"
    preferred_sampling_params: str | None = None
    max_total_tokens: int | None = None
    page_size: int = 1
    disable_radix_cache: bool = False
    schedule_conservativeness: float = 1.0
    radix_eviction_policy: str = "lru"
    radix_eviction_policy_config: str | None = None
    enable_cache_report: bool = False
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    enable_mixed_chunk: bool = False
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, body: Mapping[str, Any]) -> ServerArgs:
        """The server args in a `/server_info` body, as a client of a worker reads them: each
        field of ours that the body gives with the right type, the default (or "" for a name)
        for one it leaves out or gives wrong."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = body.get(f.name)
            if _is(value, f.type):
                values[f.name] = value
            elif f.default is dataclasses.MISSING:
                values[f.name] = ""
        return cls(**values)


def _is(value: Any, annotation: Any) -> bool:
    """Whether `value` fits a field annotated `annotation` (one of ServerArgs' few: str, int,
    float, bool, each maybe `| None`); a bool is not an int here, an int is a float."""
    kinds = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "None": (type(None),)}
    for name in str(annotation).split(" | "):
        if isinstance(value, kinds[name]) and not (isinstance(value, bool) and name != "bool"):
            return True
    return False


def max_running_requests(body: Mapping[str, Any]) -> int | None:
    """How many requests a server runs at once, from its `/server_info`: SGLang's effective limit
    per DP rank (in `internal_states`; the server argument may be unset) times its DP ranks; None
    when it does not say."""
    states = body.get("internal_states")
    first = states[0] if isinstance(states, list) and states and isinstance(states[0], Mapping) else {}
    effective = first.get("effective_max_running_requests_per_dp")
    limit = effective if _is(effective, "int") else body.get("max_running_requests")
    dp_size = body.get("dp_size")
    dp = dp_size if isinstance(dp_size, int) and not isinstance(dp_size, bool) and dp_size > 0 else 1
    return limit * dp if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def model_info(args: ServerArgs, *, is_generation: bool = True) -> dict[str, Any]:
    """`/model_info` (alias `/get_model_info`)."""
    return {
        "model_path": args.model_path,
        "served_model_name": args.served_model_name,
        "tokenizer_path": args.tokenizer_path,
        "is_generation": is_generation,
        "preferred_sampling_params": args.preferred_sampling_params,
        "weight_version": args.weight_version,
        "load_format": args.load_format,
        "reasoning_parser": args.reasoning_parser,
        "tool_call_parser": args.tool_call_parser,
        "disaggregation_mode": args.disaggregation_mode,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": MODEL_TYPE,
        "architectures": list(ARCHITECTURES),
    }


def max_req_input_len(context_length: int, kv_pool_tokens: int) -> int:
    """The longest prompt SGLang takes: what its scheduler reports as `max_req_input_len`."""
    longest = context_length - 1 if kv_pool_tokens <= 0 else min(context_length - 1, kv_pool_tokens - 1)
    return max(0, longest - INPUT_LEN_RESERVE_TOKENS)


def server_info(
    args: ServerArgs,
    *,
    max_total_num_tokens: int,
    max_req_input_len: int,
    internal_states: Sequence[Mapping[str, Any]],
    status: str = "ready",
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`/server_info` (alias `/get_server_info`): the flattened server args, the scheduler's
    info, one internal state per DP rank, the version; `extra` after them (its keys must not
    be SGLang's)."""
    body = {
        **args.as_dict(),
        "status": status,
        "max_total_num_tokens": max_total_num_tokens,
        "max_req_input_len": max_req_input_len,
        "internal_states": [dict(s) for s in internal_states],
        "version": SGLANG_VERSION,
    }
    return _beside(body, extra)


@dataclass(frozen=True, slots=True)
class Load:
    """One DP rank's core section of `/v1/loads` (SGLang's `GetLoadsReqOutput`)."""

    timestamp: float  # Unix seconds the numbers were taken at
    dp_rank: int
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_uncached_tokens: int = 0  # the queue's prompt tokens the cache will not cover
    num_used_tokens: int = 0
    num_total_tokens: int = 0  # used tokens plus those waiting to be prefilled
    num_active_tokens: int = 0  # num_total_tokens less those awaiting a KV transfer (disaggregation)
    num_prealloc_ready_tokens: int = 0
    max_total_num_tokens: int = 0
    max_running_requests: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    utilization: float = 0.0
    total_prefill_uncached_tokens: int = 0  # a counter since start
    total_prefill_busy_us: int = 0  # a counter since start
    decode_moments: tuple[float, ...] | None = None  # decode step-time moment sums
    extra: Mapping[str, Any] = field(default_factory=dict)  # beside SGLang's keys

    def as_dict(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        body["token_usage"] = round(self.token_usage, 4)
        body["gen_throughput"] = round(self.gen_throughput, 2)
        body["cache_hit_rate"] = round(self.cache_hit_rate, 4)
        body["utilization"] = round(self.utilization, 4)
        body["decode_moments"] = None if self.decode_moments is None else list(self.decode_moments)
        return _beside(body, self.extra)


# /v1/loads' `include`: the core section is always there; the others are SGLang's optional ones.
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
LOAD_FORMATS = ("json", "prometheus")
LOADS_QUERY = frozenset({"dp_rank", "include", "format"})
EVERY_SECTION = frozenset({"all"})  # SGLang's default


@dataclass(frozen=True, slots=True)
class LoadsQuery:
    dp_rank: int | None = None  # one rank only; a rank that does not exist gives no loads (as SGLang)
    include: frozenset[str] = EVERY_SECTION
    format: str = "json"


def loads_query(query: Mapping[str, str]) -> LoadsQuery:
    """`/v1/loads`' query, read as SGLang reads it; a BadRequest naming the parameter for a
    value SGLang would refuse (a dp_rank that is not an integer, an unknown section) and for
    what SGLang would ignore (an unknown parameter, an unknown format)."""
    refuse_unknown_query(query, LOADS_QUERY)
    rank = query.get("dp_rank")
    dp_rank = None
    if rank is not None:
        try:
            dp_rank = int(rank)
        except ValueError:
            raise BadRequest(f"dp_rank must be an integer, not {rank!r}.", param="dp_rank") from None
    include = EVERY_SECTION
    if query.get("include"):
        include = frozenset(s.strip() for s in query["include"].split(","))
        if unknown := include - LOAD_SECTIONS:
            raise BadRequest(
                f"Invalid include sections: {sorted(unknown)}. Valid options: {sorted(LOAD_SECTIONS)}.",
                param="include",
            )
    fmt = query.get("format") or "json"
    if fmt not in LOAD_FORMATS:
        raise BadRequest(f"format must be one of {list(LOAD_FORMATS)}, not {fmt!r}.", param="format")
    return LoadsQuery(dp_rank, include, fmt)


def refuse_unknown_query(query: Mapping[str, str], known: frozenset[str]) -> None:
    """A BadRequest naming the first query parameter not in `known`, or one given twice."""
    names = [name for name, _ in query.items()]  # a multidict's keys() says a repeated one once
    for name in names:
        if name not in known:
            allowed = f"; it takes {', '.join(sorted(known))}" if known else "; it takes none"
            raise BadRequest(f"Unknown query parameter {name!r}{allowed}.", param=name)
        if names.count(name) > 1:
            raise BadRequest(f"Query parameter {name!r} is given more than once.", param=name)


def loads_body(
    loads: Sequence[Load],
    *,
    accelerator: str | None,
    num_accelerators: int,
    now_unix_s: float,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`/v1/loads` as JSON."""
    body = {
        "timestamp": datetime.fromtimestamp(now_unix_s, UTC).isoformat(),
        "version": SGLANG_VERSION,
        "accelerator": accelerator,
        "num_accelerators": num_accelerators,
        "loads": [load.as_dict() for load in loads],
    }
    return _beside(body, extra)


def loads_prometheus(loads: Sequence[Load]) -> str:
    """`/v1/loads?format=prometheus`: each numeric core field a gauge `sglang_<field>`, labelled
    with its dp_rank (SGLang's exposition of the same numbers; what is not a number, such as
    `decode_moments`, is left out as SGLang leaves it)."""
    lines: list[str] = []
    names = [f.name for f in dataclasses.fields(Load) if f.name not in ("dp_rank", "extra")]
    for name in names:
        samples = [(load.dp_rank, load.as_dict()[name]) for load in loads]
        numbers = [(rank, v) for rank, v in samples if _is(v, "float") and math.isfinite(v)]
        if numbers:
            lines.append(f"# TYPE sglang_{name} gauge")
            lines.extend(f'sglang_{name}{{dp_rank="{rank}"}} {value}' for rank, value in numbers)
    return "\n".join(lines) + "\n"


def _beside(body: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """`body` with `extra`'s keys after its own; a key of SGLang's is never replaced."""
    for key, value in (extra or {}).items():
        if key in body:
            raise ValueError(f"{key!r} is SGLang's key: an addition goes beside it, not in its place")
        body[key] = value
    return body
