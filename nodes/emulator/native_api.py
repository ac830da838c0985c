"""SGLang's native HTTP endpoints: /generate, health, info, loads, metrics, control.

Shapes follow SGLang 0.5.23 (see REFERENCE.md §1); `/get_load` keeps the 0.5.4 shape
because older routers, sglang-router 0.3.2's power_of_two among them, poll it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from core import sglang_info, tokens
from core.sglang_info import Load, ServerArgs
from nodes.emulator.output import GenerateSpec
from nodes.emulator.params import (
    BodyError,
    ContractError,
    RequestError,
    check_sampling_contract,
    request_priority,
)
from nodes.emulator.radix_cache import pack_ids
from nodes.emulator.schedule_policy import WAITING_QUEUE_PREFIX_MATCH_MAX
from nodes.emulator.streaming import EventStream
from nodes.emulator.web_common import (
    SSE_DONE,
    WORKER_KEY,
    json_response,
    read_json_object,
    sse,
    sse_reply,
    start_sse,
)
from nodes.emulator.worker import DuplicateRequestId, EmulatedWorker, Generation

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # /generate's default in SGLang
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
HEALTH_CHECK_IDS = pack_ids([0])  # SGLang's health generation prompts with input_ids [0]


def encode_prompt(text: str) -> list[int]:
    try:
        return tokens.encode(text)
    except tokens.PromptTooLong as exc:
        raise RequestError(f"The input is longer than the model's context length: {exc}.") from None


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if not isinstance(text, str):
            raise RequestError("The emulator serves one prompt per request; send `text` as a string.")
        if not (ids := encode_prompt(text)):  # nothing to prefill: no step would ever take it
            raise RequestError("input_ids cannot be empty.")
        return ids
    if not isinstance(input_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in input_ids):
        raise RequestError("The emulator serves one prompt per request; send `input_ids` as a list of ints.")
    if not input_ids:
        raise RequestError("input_ids cannot be empty.")
    bad = next((i for i in input_ids if not 0 <= i < tokens.VOCAB_SIZE), None)
    if bad is not None:
        raise RequestError(f"Token id {bad} is out of the vocabulary [0, {tokens.VOCAB_SIZE}).")
    return input_ids


def cache_key_field(body: dict[str, Any], name: str) -> str | None:
    """`extra_key` or `cache_salt` of a one-prompt request, normalized as SGLang's
    GenerateReqInput does (an empty string is none)."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != 1:
            raise RequestError(f"The length of {name} should be equal to the batch size.")
        if not isinstance(value[0], str):
            raise RequestError(f"Every {name} should be a string.")
        value = value[0]
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{name} should be a list or a string.")
    return value or None


def generate_spec(worker: EmulatedWorker, body: dict[str, Any]) -> GenerateSpec:
    """Validate a /generate body the way SGLang does, in SGLang's order."""
    sampling = check_sampling_contract(body.get("sampling_params"))
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BodyError(
            f"[{{'type': 'string_type', 'loc': ('body', 'rid'), 'msg': 'Input should be a valid string', 'input': {rid!r}}}]"
        )
    ids = _prompt_ids(body)
    return worker.spec_for(
        sampling,
        len(ids),
        rid=rid,
        streaming=body.get("stream") is True,
        default_max_new_tokens=GENERATE_DEFAULT_MAX_NEW_TOKENS,
        prompt_ids=_chat_prompt_ids(body, ids),
        cache_ids=ids,
        extra_key=cache_key_field(body, "extra_key"),
        cache_salt=cache_key_field(body, "cache_salt"),
        top_logprobs=_top_logprobs(body),
        priority=request_priority(body),
    )


def _top_logprobs(body: dict[str, Any]) -> int | None:
    """SGLang's return_logprob / top_logprobs_num: None when not asked."""
    if not body.get("return_logprob"):
        return None
    n = body.get("top_logprobs_num", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise RequestError(f"top_logprobs_num must be a non-negative integer, got {n!r}.")
    return n


def _chat_prompt_ids(body: dict[str, Any], ids: list[int]) -> list[int] | None:
    """The prompt's ids if it may be a Harmony chat (which is then answered in Harmony)."""
    text = body.get("text")
    if not isinstance(text, str) or "<|start|>assistant" in text:
        return ids
    return None


def meta_info(gen: Generation, completion_tokens: int) -> dict[str, Any]:
    finish = gen.finish_reason()
    if gen.aborted_in_queue:
        return {
            "id": gen.spec.rid,
            "finish_reason": finish,
            "weight_version": "default",
            "completion_tokens": completion_tokens,
            "e2e_latency": gen.e2e_latency_s(),
            "response_sent_to_client_ts": time.time(),
        }
    meta: dict[str, Any] = {
        "id": gen.spec.rid,
        "finish_reason": finish,
        "prompt_tokens": gen.spec.prompt_tokens,
        "weight_version": "default",
        "num_retractions": gen.seq.retractions,
        "reasoning_tokens": 0,
        "completion_tokens": completion_tokens,
        "cached_tokens": gen.seq.cached_tokens,
        "cached_tokens_details": cached_tokens_details(gen.seq.cached_tokens),
    }
    if finish is not None:
        meta["e2e_latency"] = gen.e2e_latency_s()
        meta["response_sent_to_client_ts"] = time.time()
    return meta


def cached_tokens_details(cached: int) -> dict[str, int] | None:
    """SGLang's meta_info cached_tokens_details: none without a hit, else by tier (no HiCache here)."""
    return {"device": cached, "host": 0} if cached else None


async def handle_generate(request: web.Request) -> web.StreamResponse:
    worker = request.app[WORKER_KEY]
    body = await read_json_object(request)
    stream = body.get("stream") is True
    try:
        spec = generate_spec(worker, body)
        gen = await worker.submit(spec)
    except ContractError as exc:
        return json_response({"error": str(exc)}, 400)
    except (RequestError, DuplicateRequestId) as exc:
        if not stream:
            return json_response({"error": {"message": str(exc)}}, 400)
        error = {"message": str(exc), "type": "invalid_request_error", "code": 400, "retryable": False}
        return await sse_reply(request, [sse({"error": error}), SSE_DONE])
    try:
        if not stream:
            await gen.ended()
            return json_response(_generate_event(gen, gen.tokens_now(), 0))
        response = await start_sse(request)
        incremental = worker.config.incremental_streaming_output

        def event(since: int, k: int) -> bytes:
            return sse(_generate_event(gen, k, since if incremental else 0, incremental=incremental))

        sent = await EventStream(gen, request, response, event).run()
        await response.write(event(sent, gen.tokens_now()) + SSE_DONE)
        return response
    finally:
        worker.release(gen)


def _generate_event(gen: Generation, k: int, since: int, *, incremental: bool = False) -> dict[str, Any]:
    """Everything after `since` tokens up to `k` (since = 0: cumulative). A request aborted in the
    waiting queue, never admitted or retracted back to it, ends as SGLang 0.5.23 ends it
    (TokenizerManager._handle_abort_req): its whole text so far, and every id or, streamed in
    increments, the last one again."""
    if gen.aborted_in_queue:
        text, ids = gen.output(0, k)
        if incremental:
            ids = ids[-1:]
        since = k - len(ids)
    else:
        text, ids = gen.output(since, k)
    meta = meta_info(gen, k)
    if gen.spec.top_logprobs is not None:
        meta["output_token_logprobs"] = [[logprob(since + i, t), t, None] for i, t in enumerate(ids)]
        meta["output_top_logprobs"] = [top_logprobs(since + i, t, gen.spec.top_logprobs) for i, t in enumerate(ids)]
    return {"text": text, "output_ids": ids, "meta_info": meta}


def logprob(position: int, token: int) -> float:
    """An emulated log probability for the token at a position: deterministic, in [-4, 0]."""
    return -((token * 2_654_435_761 + position * 40_503) % 4_000) / 1_000


def top_logprobs(position: int, token: int, n: int) -> list[list[Any]]:
    """The `n` most likely tokens at a position, most likely first: the one written, then others."""
    chosen = logprob(position, token)
    alternatives = [
        ((token + 7_919 * (j + 1)) % tokens.HARMONY_SPECIALS["<|startoftext|>"], chosen - 0.5 * (j + 1))
        for j in range(n - 1)
    ]
    return [[lp, t, None] for t, lp in [(token, chosen), *alternatives]][:n]


async def handle_health(request: web.Request) -> web.Response:
    """SGLang 0.5.23 runs a 1-token generation: under overload it is slow, as on a GPU."""
    worker = request.app[WORKER_KEY]
    if worker.faults.unhealthy:
        return web.Response(status=503)
    spec = GenerateSpec(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_tokens=1, max_new_tokens=1, prompt_ids=HEALTH_CHECK_IDS
    )
    gen = await worker.submit(spec)
    try:
        async with asyncio.timeout(HEALTH_CHECK_TIMEOUT_S):
            await gen.seq.first_token
    except TimeoutError:
        return web.Response(status=503)
    finally:
        worker.release(gen)
    return web.Response(status=200)


def _server_args(worker: EmulatedWorker) -> ServerArgs:
    c, e = worker.config, worker.engine
    return ServerArgs(
        model_path=c.model_path,
        tokenizer_path=c.tokenizer_path,
        served_model_name=c.served_model_name,
        host=c.host,
        port=c.port,
        tp_size=c.tp_size,
        context_length=c.context_length,
        chunked_prefill_size=c.profile.chunked_prefill_tokens,
        max_running_requests=e.max_running_requests,
        max_total_tokens=c.max_total_tokens,
        page_size=c.cache.page_size,
        disable_radix_cache=c.cache.disable_radix_cache,
        schedule_policy=c.cache.schedule_policy,
        enable_cache_report=c.enable_cache_report,
        swa_full_tokens_ratio=c.cache.swa_full_tokens_ratio,
        stream_interval=c.stream_interval,
        incremental_streaming_output=c.incremental_streaming_output,
        enable_metrics=True,
        enable_mixed_chunk=True,
        quantization=c.quantization,
        enable_priority_scheduling=c.cache.priority.enabled,
        schedule_low_priority_values_first=c.cache.priority.low_values_first,
    )


async def handle_model_info(request: web.Request) -> web.Response:
    return json_response(sglang_info.model_info(_server_args(request.app[WORKER_KEY])))


async def handle_server_info(request: web.Request) -> web.Response:
    worker = request.app[WORKER_KEY]
    e = worker.engine
    args = _server_args(worker)
    internal = {
        **args.as_dict(),
        "world_size": 1,
        "effective_max_running_requests_per_dp": e.max_running_requests,
        "last_gen_throughput": worker.metrics.last_gen_throughput(),
        "memory_usage": {"token_capacity": e.kv_capacity_tokens, "token_capacity_swa": e.pools.swa_capacity},
    }
    body = sglang_info.server_info(
        args,
        max_total_num_tokens=e.kv_capacity_tokens,
        max_req_input_len=sglang_info.max_req_input_len(worker.config.context_length, e.kv_capacity_tokens),
        internal_states=[internal],
        extra={"frontend": "python", "emulated_gpu": worker.config.profile.name},
    )
    return json_response(body)


def _waiting_uncached_tokens(worker: EmulatedWorker) -> int:
    """SGLang's estimate of the queue's prompt tokens still to compute (`load_inquirer.py`): with
    lpm, each one's last match; otherwise each one's length less the recent hit rate's share; plus
    what the chunked request has left."""
    e = worker.engine
    if e.cache.config.schedule_policy == "lpm" and e.cache.enabled and len(e.waiting) <= WAITING_QUEUE_PREFIX_MATCH_MAX:
        queued = sum(max(0, s.prompt_tokens + s.generated - s.matched) for s in e.waiting)
    else:
        miss = 1.0 - worker.metrics.recent_cache_hit_rate()
        queued = sum(int((s.prompt_tokens + s.generated) * miss) for s in e.waiting)
    return queued + sum(s.prefill_left - s.chunk for s in e.prefilling)


def _load(worker: EmulatedWorker) -> Load:
    e = worker.engine
    pools = e.pool_usage()
    used = pools.num_used_tokens
    report = worker.metrics.report()
    return Load(
        timestamp=time.time(),
        dp_rank=0,
        num_running_reqs=e.running_count,
        num_waiting_reqs=e.waiting_count,
        num_waiting_uncached_tokens=_waiting_uncached_tokens(worker),
        num_used_tokens=used,
        num_total_tokens=used + sum(s.prompt_tokens + s.generated for s in e.waiting),
        num_active_tokens=used,
        max_total_num_tokens=e.kv_capacity_tokens,
        max_running_requests=e.max_running_requests,
        token_usage=pools.usage,
        gen_throughput=report.gen_throughput,
        cache_hit_rate=report.cache_hit_rate,
        utilization=e.running_count / e.max_running_requests,
        total_prefill_uncached_tokens=report.prefill_compute_tokens,
    )


async def handle_loads(request: web.Request) -> web.Response:
    """SGLang's /v1/loads for the one DP rank an emulated worker has (`format=prometheus` too)."""
    worker = request.app[WORKER_KEY]
    loads = [_load(worker)]
    if request.query.get("format") == "prometheus":
        return web.Response(text=sglang_info.loads_prometheus(loads), content_type="text/plain")
    body = sglang_info.loads_body(
        loads,
        accelerator=f"AMD Instinct {worker.config.profile.name.upper()} (emulated)",
        num_accelerators=1,
        now_unix_s=time.time(),
    )
    return json_response(body)


async def handle_get_load(request: web.Request) -> web.Response:
    """SGLang 0.5.4's /get_load, still polled by older routers."""
    e = request.app[WORKER_KEY].engine
    waiting_tokens = sum(s.prompt_tokens for s in e.waiting)
    entry = {
        "rid": None,
        "http_worker_ipc": None,
        "dp_rank": 0,
        "num_reqs": e.running_count + e.waiting_count,
        "num_waiting_reqs": e.waiting_count,
        "num_tokens": e.pool_usage().num_used_tokens + waiting_tokens,
    }
    return json_response([entry])


FLUSHING_KEY = web.AppKey("flushing", asyncio.Event)
FLUSH_POLL_S = 0.01  # how often a flush waiting for idle looks again (SGLang checks every round)


async def handle_flush_cache(request: web.Request) -> web.Response:
    """Empty the prefix cache, only when nothing runs or waits; `?timeout=S` waits up to S seconds
    for that (SGLang's SchedulerFlushWrapper). 400 when it did not happen."""
    worker = request.app[WORKER_KEY]
    try:
        timeout_s = float(request.query.get("timeout", "0"))
    except ValueError:
        timeout_s = -1.0
    if not timeout_s >= 0.0:
        return json_response({"detail": "timeout must be a number >= 0"}, 422)
    flushing = request.app[FLUSHING_KEY]
    if flushing.is_set():
        return web.Response(status=400, text="Another flush_cache is already in progress.")
    flushing.set()
    try:
        done = worker.flush_cache()
        deadline = time.monotonic() + timeout_s
        while not done and time.monotonic() < deadline:
            await asyncio.sleep(FLUSH_POLL_S)
            done = worker.flush_cache()
    finally:
        flushing.clear()
    if not done:
        message = "Timed out waiting for idle state." if timeout_s > 0 else "Flush cache failed.\n"
        return web.Response(status=400, text=message)
    return web.Response(
        text="Cache flushed.\nPlease check backend logs for more details. (When there are "
        "running or waiting requests, the operation will not be performed.)\n"
    )


async def handle_abort_request(request: web.Request) -> web.Response:
    worker = request.app[WORKER_KEY]
    body = await read_json_object(request)
    rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
    if not isinstance(rid, str):
        return json_response({"error": {"message": "rid must be a string"}}, 400)
    if abort_all:
        worker.abort_all("Abort requested by /abort_request")
    elif rid:
        worker.abort_prefix(rid)
    return web.Response(status=200)


async def handle_metrics(request: web.Request) -> web.Response:
    body = request.app[WORKER_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def handle_models(request: web.Request) -> web.Response:
    c = request.app[WORKER_KEY].config
    model = {
        "id": c.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": c.served_model_name,
        "parent": None,
        "max_model_len": c.context_length,
    }
    return json_response({"object": "list", "data": [model]})


ROUTES: list[tuple[str, str, Callable[[web.Request], Any]]] = [
    ("POST", "/generate", handle_generate),
    ("GET", "/health", handle_health),
    ("GET", "/health_generate", handle_health),
    ("GET", "/model_info", handle_model_info),
    ("GET", "/get_model_info", handle_model_info),
    ("GET", "/server_info", handle_server_info),
    ("GET", "/get_server_info", handle_server_info),
    ("GET", "/v1/loads", handle_loads),
    ("GET", "/get_load", handle_get_load),
    ("GET", "/flush_cache", handle_flush_cache),
    ("POST", "/flush_cache", handle_flush_cache),
    ("POST", "/abort_request", handle_abort_request),
    ("GET", "/metrics", handle_metrics),
    ("GET", "/v1/models", handle_models),
]
