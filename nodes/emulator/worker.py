"""One emulated SGLang worker: engine, metrics, faults and the requests in flight.

The HTTP layers (`native_api`, `openai_api`) parse and answer; this module owns what
a request does inside the server: the TTFT fixed cost, the engine, the abort path.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from core import tokens
from core.gpus import MODEL_CONTEXT_TOKENS, GpuProfile
from nodes.emulator.engine import Engine
from nodes.emulator.harmony_answer import constraints
from nodes.emulator.metrics import WorkerMetrics
from nodes.emulator.output import GenerateSpec, OutputPlan, plan_output
from nodes.emulator.params import resolve_max_new_tokens, verify_sampling
from nodes.emulator.prefix_cache import CacheConfig, namespace
from nodes.emulator.radix_cache import pack_ids
from nodes.emulator.sequence import Sequence


class DuplicateRequestId(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    profile: GpuProfile
    port: int
    host: str = "127.0.0.1"
    speed: float = 1.0
    model_path: str = "openai/gpt-oss-120b"
    served_model_name: str = "openai/gpt-oss-120b"
    tokenizer_path: str = "openai/gpt-oss-120b"
    mean_output_tokens: float = 1278.0  # MLPerf gpt-oss-120b mean output length
    max_running_requests: int | None = None
    max_total_tokens: int | None = None  # SGLang's --max-total-tokens: the KV pool (None: the GPU's)
    # Decode steps between a stream's events, SGLang's --stream-interval: 1 (its default) is an
    # event per token; a request's sampling_params.stream_interval overrides it.
    stream_interval: int = 1
    context_length: int = MODEL_CONTEXT_TOKENS
    incremental_streaming_output: bool = False
    tp_size: int = 1  # GPUs the worker spans (its profile is already scaled to them)
    quantization: str | None = None  # SGLang's --quantization, as /server_info reports it
    cache: CacheConfig = field(
        default_factory=CacheConfig
    )  # the prefix cache and admission order (--disable-radix-cache, ...)
    enable_cache_report: bool = False  # --enable-cache-report: OpenAI usage carries cached tokens


@dataclass(slots=True)
class Faults:
    """Drill faults. Served under /_emulator/ and settable by flags."""

    slowdown: float = 1.0  # brownout: every step takes this many times longer
    unhealthy: bool = False  # /health and /health_generate answer 503
    hang: bool = False  # accept requests, never answer
    dead: bool = False  # the worker has died: its port is closed


@dataclass(eq=False, slots=True)
class Generation:
    spec: GenerateSpec
    plan: OutputPlan
    seq: Sequence
    worker: EmulatedWorker = field(repr=False)

    @property
    def finished(self) -> bool:
        return self.seq.done.done()

    async def ended(self) -> None:
        """Wait for the finish or an abort. Shielded: a cancelled handler (its client left) must
        not cancel the engine's future, or the request would look finished and never be aborted."""
        await asyncio.shield(self.seq.done)

    def tokens_now(self) -> int:
        return self.worker.engine.generated_tokens(self.seq)

    def output(self, since: int, k: int) -> tuple[str, list[int]]:
        """Text and ids between `since` and `k` tokens (0: from the start)."""
        return self.plan.delta(self.worker.synth, since, k)

    @property
    def stream_interval(self) -> int:
        return self.spec.stream_interval or self.worker.config.stream_interval

    @property
    def aborted_in_queue(self) -> bool:
        return self.seq.aborted_waiting  # set by the engine's abort, with its message

    def finish_reason(self) -> dict[str, object] | None:
        """SGLang's finish_reason: None while running."""
        if self.aborted_in_queue:
            return {"type": "abort", "message": "Abort in waiting queue"}
        if self.seq.abort_message is not None:
            return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        return self.plan.finish_reason if self.finished else None

    def e2e_latency_s(self) -> float:
        """Wall seconds from arrival to the end (to now while running)."""
        seq = self.seq
        end = seq.finished_at or asyncio.get_running_loop().time()
        return end - seq.arrived_at


class EmulatedWorker:
    def __init__(self, config: WorkerConfig, faults: Faults | None = None) -> None:
        self.config = config
        self.faults = faults or Faults()
        self.metrics = WorkerMetrics(config.served_model_name)
        self.engine = Engine(
            config.profile,
            speed=config.speed,
            max_running_requests=config.max_running_requests,
            kv_capacity_tokens=config.max_total_tokens,
            cache=config.cache,
            listener=self.metrics,
        )
        self.engine.set_slowdown(self.faults.slowdown)
        self.metrics.attach(self.engine)
        self.synth = tokens.synthetic_text()
        self.in_flight: dict[str, Generation] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.engine.run())

    async def stop(self) -> None:
        self.abort_all("Server is shutting down")
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def spec_for(
        self,
        sampling: dict[str, Any],
        prompt_tokens: int,
        *,
        rid: str | None,
        streaming: bool,
        default_max_new_tokens: int | None,
        prompt_ids: list[int] | None = None,
        cache_ids: list[int] | None = None,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        top_logprobs: int | None = None,
        priority: int | None = None,
    ) -> GenerateSpec:
        """Verify sampling parameters and lengths as SGLang does (raises RequestError).
        `prompt_ids`, when known: a Harmony chat prompt among them is answered in Harmony.
        `cache_ids`: the prompt's token ids, what the prefix cache matches (with `extra_key` and
        `cache_salt`, which keep requests from sharing)."""
        params = verify_sampling(sampling, default_max_new_tokens=default_max_new_tokens)
        max_new = resolve_max_new_tokens(
            prompt_tokens,
            params.max_new_tokens,
            explicit="max_new_tokens" in sampling,
            context_length=self.config.context_length,
            kv_capacity_tokens=self.engine.kv_capacity_tokens,
        )
        return GenerateSpec(
            rid=rid or uuid.uuid4().hex,
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new,
            min_new_tokens=min(params.min_new_tokens, max_new),
            stop=params.stop,
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
            no_stop_trim=params.no_stop_trim,
            seed=params.seed,
            streaming=streaming,
            stream_interval=params.stream_interval,
            top_logprobs=top_logprobs,
            priority=priority,
            prompt_ids=pack_ids(cache_ids) if cache_ids else b"",
            cache_namespace=namespace(extra_key, cache_salt),
            **constraints(sampling, prompt_ids),
        )

    def set_slowdown(self, factor: float) -> None:
        self.faults.slowdown = factor
        self.engine.set_slowdown(factor)

    def flush_cache(self) -> bool:
        """Empty the prefix cache if nothing is running or waiting (SGLang's flush_cache)."""
        if not self.engine.flush_cache():
            return False
        self.metrics.on_flush()
        return True

    async def submit(self, spec: GenerateSpec) -> Generation:
        """Admit a request: the fixed pre-GPU cost, then the engine's queue."""
        if spec.rid in self.in_flight:
            raise DuplicateRequestId(f"Duplicate request ID: {spec.rid}")
        loop = asyncio.get_running_loop()
        plan = plan_output(spec, self.synth, self.config.mean_output_tokens)
        synth = self.synth
        seq = Sequence(
            rid=spec.rid,
            prompt_tokens=spec.prompt_tokens,
            target_tokens=plan.tokens,
            max_new_tokens=spec.max_new_tokens,
            arrived_at=loop.time(),
            streaming=spec.streaming,
            ids=spec.prompt_ids,
            namespace=spec.cache_namespace,
            output_ids=lambda n: pack_ids(plan.token_ids(synth, n)),
            priority=self.config.cache.priority.value_of(spec.priority),  # ignored unless enabled
        )
        gen = Generation(spec, plan, seq, self)
        self.in_flight[spec.rid] = gen
        try:
            c0_s = self.config.profile.ttft_fixed_ms / 1000.0 / self.config.speed
            await asyncio.sleep(c0_s * self.faults.slowdown)
        except asyncio.CancelledError:
            del self.in_flight[spec.rid]
            raise
        if seq.abort_message is None:
            self.engine.submit(seq)
        return gen

    def release(self, gen: Generation) -> None:
        """The HTTP side is done with `gen`: abort it if it is still running (client gone)."""
        self.in_flight.pop(gen.spec.rid, None)
        if not gen.finished:
            self.abort(gen, "The client disconnected")

    def abort(self, gen: Generation, message: str) -> None:
        if gen.seq.abort_message is None and not gen.finished:
            self.metrics.on_abort(gen.seq)
            self.engine.abort(gen.seq, message)

    def abort_prefix(self, rid: str) -> None:
        """SGLang's /abort_request matches request ids by prefix."""
        for key, gen in list(self.in_flight.items()):
            if key.startswith(rid):
                self.abort(gen, "Abort requested by /abort_request")

    def abort_all(self, message: str) -> None:
        for gen in list(self.in_flight.values()):
            self.abort(gen, message)
