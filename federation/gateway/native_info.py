"""SGLang's native information endpoints over the whole federation, so SGLang's own tools (its
router, `bench_serving`, the model gateway, dashboards polling `/v1/loads`) work against the
endpoint: `/model_info`, `/server_info` (aliases `/get_model_info`, `/get_server_info`) and
`/v1/loads`, in SGLang's shapes (`core/sglang_info.py`), filled with the federation's values.

The federation is shown as SGLang shows data parallelism: **one DP rank per site** the
schedulers know, in the order of their names (`dp_rank` is the index; each rank says its site
under `federation`). `internal_states` and `loads` list the same sites, whatever their status
(a draining site still holds work; a down one says so), and `dp_size` is their number. The
totals at the top of `/server_info` (`max_total_num_tokens`, `max_running_requests`) are those
of the sites that can take work now (ready, with a healthy worker), as `/health` counts them.

Everything comes from the state the gateway already watches from the schedulers
(`schedulers.py`): nothing is asked per request (one GetState only before the first state
arrives, as `/health` does). Per site, that state says what its workers last reported of their
load (requests running, KV tokens in use and the pool's share of them, generation throughput),
its requests waiting, its running slots, its workers and GPUs; `utilization` is running over
slots. The KV pool (`max_total_num_tokens`) is the GPU profile's (`core/gpus.py`) times the GPUs
of the site's healthy workers: declared, not measured. What no report carries is 0 and named in
`federation.unreported`: the tokens waiting to be prefilled (`num_total_tokens` is the used
ones only) and the prefix cache's hit rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from core import sglang_info, wire
from core.gpus import PROFILES
from core.sglang_info import Load, ServerArgs
from federation.gateway.schedulers import Schedulers

# Numbers SGLang reports that the federation's state does not carry: answered as 0.
UNREPORTED = ("num_total_tokens", "cache_hit_rate")
PARSER = "gpt-oss"  # the gateway renders and parses Harmony as SGLang's gpt-oss parsers do
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Site:
    """One site as a DP rank: its state and what follows from it."""

    rank: int
    state: wire.SiteState
    report_unix_s: float  # when its last report reached the schedulers

    @property
    def serving(self) -> bool:
        """Can take work now (as /health counts a site ready)."""
        return self.state.status is wire.SiteStatus.READY and self.state.healthy_workers > 0

    @property
    def tp_size(self) -> int:
        """GPUs per worker."""
        s = self.state
        return max(1, s.gpus // s.total_workers) if s.total_workers else 1

    @property
    def worker_kv_tokens(self) -> int:
        """One worker's KV pool, by its GPU profile (0: a GPU without one)."""
        profile = PROFILES.get(self.state.gpu)
        return profile.kv_capacity_tokens * self.tp_size if profile else 0

    @property
    def kv_tokens(self) -> int:
        return self.worker_kv_tokens * self.state.healthy_workers

    @property
    def running(self) -> int:
        return self.state.running_requests

    def summary(self) -> dict[str, Any]:
        """The site as the federation knows it (no addresses: an API key holder reads this)."""
        s = self.state
        return {
            "site": s.name,
            "region": s.region,
            "gpu": s.gpu,
            "gpus": s.gpus,
            "checkpoint": s.checkpoint,
            "weight_format": s.weight_format,
            "status": s.status.label,
            "healthy_workers": s.healthy_workers,
            "total_workers": s.total_workers,
            "slots": s.slots,
            "capacity_tok_s": round(s.capacity_tok_s, 1),
            "prior_capacity_tok_s": round(s.prior_capacity_tok_s, 1),
            "capacity_evidence": s.capacity_evidence,
            "outstanding_requests": s.outstanding_requests,
            "outstanding_tokens": s.outstanding_tokens,
            "queued_requests": s.queued_requests,
            "routed_requests": s.routed_requests,
            "last_report_age_s": round(s.last_report_age_s, 3),
        }

    def load(self) -> Load:
        s = self.state
        return Load(
            dp_rank=self.rank,
            timestamp=self.report_unix_s,
            num_running_reqs=self.running,
            num_waiting_reqs=s.queued_requests,
            num_used_tokens=s.context_tokens,
            num_total_tokens=s.context_tokens,
            num_active_tokens=s.context_tokens,  # num_total_tokens outside disaggregated decode, as SGLang's
            max_total_num_tokens=self.kv_tokens,
            token_usage=s.kv_usage,
            gen_throughput=s.gen_throughput_tok_s,
            utilization=self.running / s.slots if s.slots else 0.0,
            max_running_requests=s.slots,
            extra={"federation": self.summary()},
        )


def accelerator(gpu: str) -> str:
    return f"AMD Instinct {gpu.upper()}"


class NativeInfo:
    """The three endpoints for one gateway: the model it serves, its context, its schedulers'
    watched state (`schedulers` is read at each request: it is made at the app's start-up)."""

    def __init__(self, model: str, context_tokens: int, schedulers: Callable[[], Schedulers]) -> None:
        self.model = model
        self.context_tokens = context_tokens
        self._schedulers = schedulers

    def add_routes(self, router: web.UrlDispatcher) -> None:
        for path in ("/model_info", "/get_model_info"):
            router.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            router.add_get(path, self.server_info)
        router.add_get("/v1/loads", self.loads)

    async def model_info(self, request: web.Request) -> web.Response:
        sglang_info.refuse_unknown_query(request.query, frozenset())
        return _json(sglang_info.model_info(self._args(request, [])))

    async def server_info(self, request: web.Request) -> web.Response:
        sglang_info.refuse_unknown_query(request.query, frozenset())
        schedulers = self._schedulers()
        sites, age_s = await self._sites()
        serving = [s for s in sites if s.serving]
        args = self._args(request, sites)
        internal = [
            {
                **ServerArgs(**{**args.as_dict(), "tp_size": s.tp_size, "dp_size": 1}).as_dict(),
                "dp_rank": s.rank,
                "max_total_num_tokens": s.kv_tokens,
                "max_running_requests": s.state.slots,
                "effective_max_running_requests_per_dp": s.state.slots,
                "last_gen_throughput": s.state.gen_throughput_tok_s,
                "memory_usage": {"token_capacity": s.kv_tokens},
                "federation": s.summary(),
            }
            for s in sites
        ]
        smallest_worker_kv = min((s.worker_kv_tokens for s in serving), default=0)
        body = sglang_info.server_info(
            args,
            max_total_num_tokens=sum(s.kv_tokens for s in serving),
            max_req_input_len=sglang_info.max_req_input_len(self.context_tokens, smallest_worker_kv),
            internal_states=internal,
            status="ready" if serving else "no_ready_site",
            extra={
                "federation": {
                    "scheduler": schedulers.watching,
                    "degraded": schedulers.degraded,
                    "state_age_s": age_s,
                    "ready_sites": [s.state.name for s in serving],
                    "unreported": list(UNREPORTED),
                }
            },
        )
        return _json(body)

    async def loads(self, request: web.Request) -> web.Response:
        query = sglang_info.loads_query(request.query)
        schedulers = self._schedulers()
        sites, age_s = await self._sites()
        if query.dp_rank is not None:
            sites = [s for s in sites if s.rank == query.dp_rank]
        loads = [s.load() for s in sites]
        if query.format == "prometheus":
            return web.Response(text=sglang_info.loads_prometheus(loads), headers={"Content-Type": PROMETHEUS_TEXT})
        gpus = list(dict.fromkeys(s.state.gpu for s in sites))  # in rank order, once each
        body = sglang_info.loads_body(
            loads,
            accelerator=" + ".join(accelerator(g) for g in gpus) if gpus else None,
            num_accelerators=sum(s.state.gpus for s in sites),
            now_unix_s=time.time(),
            extra={
                "federation": {
                    "degraded": schedulers.degraded,
                    "state_age_s": age_s,
                    "unreported": list(UNREPORTED),
                }
            },
        )
        return _json(body)

    def _args(self, request: web.Request, sites: list[Site]) -> ServerArgs:
        """The federation's server args: its model, its address as this client reached it, its
        sites as DP ranks."""
        host, port = _listening(request)
        tp_sizes = {s.tp_size for s in sites}
        return ServerArgs(
            model_path=self.model,
            served_model_name=self.model,
            tokenizer_path=self.model,  # every site's tokenizer is the federation's (the schedulers check)
            host=host,
            port=port,
            tp_size=min(tp_sizes, default=1),  # the sites' when they agree; each rank says its own
            dp_size=len(sites),
            context_length=self.context_tokens,
            max_running_requests=sum(s.state.slots for s in sites if s.serving),
            stream_interval=1,  # the workers' (--stream-interval 1); the agents coalesce on a timer
            incremental_streaming_output=False,  # /generate streams cumulatively, as SGLang's default
            enable_metrics=True,
            reasoning_parser=PARSER,
            tool_call_parser=PARSER,
        )

    async def _sites(self) -> tuple[list[Site], float | None]:
        """The sites of the last state watched, as DP ranks, and that state's age (None: just
        asked for, no state having been watched yet)."""
        schedulers = self._schedulers()
        state, seen_at, age_s = schedulers.state, schedulers.state_at, None
        if state is None:
            state, seen_at = await schedulers.get_state(), time.monotonic()
        else:
            age_s = round(time.monotonic() - seen_at, 3)
        state_unix_s = time.time() - (time.monotonic() - seen_at)
        ordered = sorted(state.sites, key=lambda s: s.name)
        return [Site(i, s, state_unix_s - s.last_report_age_s) for i, s in enumerate(ordered)], age_s


def _listening(request: web.Request) -> tuple[str, int]:
    """The address this request arrived at (several gateway processes may share it)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return str(sockname[0]), int(sockname[1])
    return request.url.host or "", request.url.port or 0


def _json(body: Any) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")
