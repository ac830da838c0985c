"""HTTP client for one SGLang worker: what it serves, health, metrics, abort, and the ways a
request to it can fail. The streamed /generate itself is `worker_stream`: the hot path.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from core import sglang_info
from core.sglang_info import ServerArgs


class WorkerRejected(Exception):
    """The worker refused the request (SGLang's 400): the client's fault, not the site's."""


class WorkerFailed(Exception):
    """The worker broke, hung up or answered with a server error: the site's fault.
    `connection_lost`: the request's connection died, which ends the request at the worker too
    (SGLang aborts a request whose client is gone; a dead worker has nothing to abort)."""

    def __init__(self, message: str, *, connection_lost: bool = False) -> None:
        super().__init__(message)
        self.connection_lost = connection_lost


class WorkerUnreachable(WorkerFailed):
    """The worker never answered: no connection could be made, or it closed before a response
    began. Nothing of the answer exists (a worker that had begun aborts a request whose client
    is gone), so another worker may take the request as if it were new."""


@dataclass(frozen=True, slots=True)
class Accounting:
    """A worker's own accounting of its work, as one read of its /metrics found it (SGLang 0.5.23
    with --enable-metrics; see nodes/agent/accounting.py for how it is used). Counters are
    cumulative since the worker started; the gauges are renewed at its log points."""

    decode_passes: float  # cuda_graph_passes_total, decode modes
    prefill_passes: float  # and prefill modes
    decode_tokens: float  # realtime_tokens_total{mode="decode"}: tokens of decode-only passes
    prefill_tokens: float  # realtime_tokens_total{mode="prefill_compute"}
    cached_tokens: float  # realtime_tokens_total{mode="prefill_cache"}
    idle_s: float  # scheduler_idle_seconds_total
    running_requests: int  # num_running_reqs: the decode batch at its last log point
    decode_context_tokens: int  # decode_sum_seq_lens: that batch's KV at the same point
    sent_at: float  # time.monotonic() when the read was asked for ...
    received_at: float  # ... and when its answer was in: the counters were read in between


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """The gauges the agent reads from a worker's /metrics."""

    running_requests: int
    queued_requests: int
    token_usage: float
    gen_throughput_tok_s: float
    used_tokens: int  # KV tokens held by the running requests: the context the GPU reads each step
    accounting: Accounting | None = None  # None: the worker does not export it


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker's /server_info says once: what it serves, how it streams and how many
    requests it runs at once."""

    incremental: bool
    max_running_requests: int | None  # None: the worker does not say; the agent then sets no limit
    served_model: str = ""  # the name it answers to ("": it does not say)
    tokenizer: str = ""
    checkpoint: str = ""  # the weights it loaded (SGLang's model_path)
    quantization: str = ""  # SGLang's --quantization ("": none given; the checkpoint's own format)
    # SGLang's --enable-mixed-chunk: a prefill pass also decodes the running batch, and SGLang
    # counts none of that decode in realtime_tokens_total{mode="decode"}.
    mixed_chunk: bool = False
    # SGLang's --enable-priority-scheduling, and --schedule-low-priority-values-first: the worker
    # orders its queue by each request's `priority` (tiers.sglang_priority): higher values first,
    # or lower ones with the second.
    priority_scheduling: bool = False
    low_priority_values_first: bool = False


def error_message(body: Any) -> str:
    """SGLang's three error shapes: {"error": str}, {"error": {"message"}}, {"message"}."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, str):
            return err
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
    return json.dumps(body)


async def abort(session: aiohttp.ClientSession, url: str, rid: str, timeout_s: float) -> None:
    """Best effort: the worker also aborts when our connection closes."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url + "/abort_request", json={"rid": rid}, timeout=timeout) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError, RuntimeError):  # RuntimeError: session closed at shutdown
        pass


async def _get_ok(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bytes | None:
    """The body of a 200 answer, or None for any other answer, a timeout or a broken connection."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return await resp.read() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def server_info(session: aiohttp.ClientSession, url: str, timeout_s: float) -> WorkerInfo | None:
    """What the worker's /server_info says (core/sglang_info.py's reading), None if it says nothing readable."""
    body = await _get_ok(session, url + "/server_info", timeout_s)
    try:
        info = json.loads(body) if body is not None else None
    except ValueError:
        return None
    if not isinstance(info, dict):
        return None
    args = ServerArgs.read(info)
    return WorkerInfo(
        incremental=args.incremental_streaming_output,
        max_running_requests=sglang_info.max_running_requests(info),
        served_model=args.served_model_name or args.model_path,
        tokenizer=args.tokenizer_path or args.model_path,
        checkpoint=args.model_path,
        quantization=args.quantization or "",
        mixed_chunk=args.enable_mixed_chunk,
        priority_scheduling=args.enable_priority_scheduling,
        low_priority_values_first=args.schedule_low_priority_values_first,
    )


class Health(enum.Enum):
    OK = "ok"
    FAILING = "failing"  # answered non-200, refused, or reset
    SLOW = "slow"  # no answer in time: SGLang's /health is a generation, queued like any under load


async def health(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Health:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return Health.OK if resp.status == 200 else Health.FAILING
    except TimeoutError:
        return Health.SLOW
    except aiohttp.ClientError:
        return Health.FAILING


GAUGES_READ = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:gen_throughput",
    "sglang:num_used_tokens",
    "sglang:decode_sum_seq_lens",
)
COUNTERS_READ = (
    "sglang:realtime_tokens",
    "sglang:cuda_graph_passes",
    "sglang:scheduler_idle_seconds",  # created at 0 when SGLang starts: its presence says the rest is exported
)
# Their sample lines ("name{labels} value", "name value"; a counter's name ends in _total) and
# their TYPE lines.
_LINE_STARTS = (
    *(f"{prefix}{name}{end}" for prefix in ("", "# TYPE ") for name in GAUGES_READ for end in "{ "),
    *(f"{name}_total{end}" for name in COUNTERS_READ for end in "{ "),
    *(f"# TYPE {name}{end}" for name in COUNTERS_READ for end in (" ", "_total ")),
)


def _lines_read(text: str) -> str:
    """Only the lines of the metrics read, with their TYPE lines. A worker's /metrics is ~25 KB,
    mostly histograms; parsing all of it for 16 workers every second took a large share of the
    agent's loop under load (docs/BENCHMARKS.md, "The 0.971 explained"), time the streams it
    relays were waiting for."""
    return "\n".join(line for line in text.splitlines() if line.startswith(_LINE_STARTS))


async def scrape(session: aiohttp.ClientSession, url: str, timeout_s: float) -> WorkerStats | None:
    """The worker's load gauges and its work accounting, or None when /metrics cannot be read."""
    sent_at = time.monotonic()
    body = await _get_ok(session, url + "/metrics", timeout_s)
    received_at = time.monotonic()
    if body is None:
        return None
    values: dict[str, float] = {}  # a family's samples summed (a counter's without its _total)
    by_mode: dict[str, float] = {}  # the labelled counters, per "name/mode"
    for family in text_string_to_metric_families(_lines_read(body.decode())):
        if family.type not in ("gauge", "counter"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            values[family.name] = values.get(family.name, 0.0) + sample.value
            if "mode" in sample.labels:
                key = f"{family.name}/{sample.labels['mode']}"
                by_mode[key] = by_mode.get(key, 0.0) + sample.value
    running = int(values.get("sglang:num_running_reqs", 0))
    accounting = None
    if "sglang:scheduler_idle_seconds" in values:
        accounting = Accounting(
            decode_passes=sum(n for key, n in by_mode.items() if key.startswith("sglang:cuda_graph_passes/decode")),
            prefill_passes=sum(n for key, n in by_mode.items() if key.startswith("sglang:cuda_graph_passes/prefill")),
            decode_tokens=by_mode.get("sglang:realtime_tokens/decode", 0.0),
            prefill_tokens=by_mode.get("sglang:realtime_tokens/prefill_compute", 0.0),
            cached_tokens=by_mode.get("sglang:realtime_tokens/prefill_cache", 0.0),
            idle_s=values["sglang:scheduler_idle_seconds"],
            running_requests=running,
            decode_context_tokens=int(values.get("sglang:decode_sum_seq_lens", 0)),
            sent_at=sent_at,
            received_at=received_at,
        )
    return WorkerStats(
        running_requests=running,
        queued_requests=int(values.get("sglang:num_queue_reqs", 0)),
        token_usage=values.get("sglang:token_usage", 0.0),
        gen_throughput_tok_s=values.get("sglang:gen_throughput", 0.0),
        used_tokens=int(values.get("sglang:num_used_tokens", 0)),
        accounting=accounting,
    )
