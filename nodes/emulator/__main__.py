"""`python -m nodes.emulator`: serve N emulated GPUs on ports P..P+N-1 from one process.

Example: `python -m nodes.emulator --profile mi355x --workers 16 --port 30000`.
It prints one `ready` line on stdout when every port accepts requests and stops
cleanly on SIGTERM or SIGINT.

It also takes `sglang.launch_server`'s command line, as a site agent's `--launch emulator`
starts it (one worker per process, core/recipes.py): the flags that change what a worker does
(`--model-path`, `--served-model-name`, `--tokenizer-path`, `--tp-size`, `--quantization`,
`--port`, `--stream-interval`, `--disable-radix-cache`, `--page-size`, `--schedule-policy`,
`--enable-cache-report`, ...) mean what they mean to SGLang; the others (kernels, memory
fractions, parsers) are accepted and named in one log line. What SGLang learns from the machine
comes from the environment: the GPU to emulate (FEDERATION_EMULATOR_GPU), the GPUs given to the
worker (HIP_VISIBLE_DEVICES: fewer than `--tp-size` fails, as on a real host), how long the model
takes to load (FEDERATION_EMULATOR_LOAD_S: no port answers meanwhile, as SGLang's does not),
and the emulation's speed and drill faults (FEDERATION_EMULATOR_SPEED, FEDERATION_EMULATOR_FAULTS).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import sys

import structlog

from core import harmony, runtime, tokens
from core.gpus import PROFILES
from nodes.emulator.prefix_cache import (
    PRIORITY_POLICIES,
    SCHEDULE_POLICIES,
    SWA_FULL_TOKENS_RATIO,
    CacheConfig,
    PriorityScheduling,
    priority_policy_refused,
)
from nodes.emulator.server import WorkerServer
from nodes.emulator.worker import Faults, WorkerConfig

log = structlog.get_logger("emulator")

GPU_ENV = "FEDERATION_EMULATOR_GPU"
SPEED_ENV = "FEDERATION_EMULATOR_SPEED"
FAULTS_ENV = "FEDERATION_EMULATOR_FAULTS"  # "1": as --enable-faults
LOAD_ENV = "FEDERATION_EMULATOR_LOAD_S"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m nodes.emulator",
        description="SGLang-compatible workers with calibrated MI300X / MI355X performance models.",
    )
    p.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=os.environ.get(GPU_ENV) or None,
        help=f"GPU to emulate (default: ${GPU_ENV})",
    )
    p.add_argument("--workers", type=runtime.positive_int, default=1, help="GPUs (one port each)")
    p.add_argument("--port", type=int, default=30000, help="first port; worker i gets port+i")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--speed",
        type=runtime.positive_float,
        default=os.environ.get(SPEED_ENV, "1"),  # a string default goes through `type` too
        help=f"0.1 = GPUs ten times slower (default: ${SPEED_ENV}, else 1)",
    )
    p.add_argument("--max-running-requests", type=runtime.positive_int, default=None)
    p.add_argument(
        "--max-total-tokens",
        type=runtime.positive_int,
        default=None,
        help="the KV pool's size in tokens, as SGLang's (default: what the GPU holds)",
    )
    p.add_argument(
        "--mean-output-tokens",
        type=runtime.positive_float,
        default=1278.0,
        help="mean answer length when EOS is not ignored",
    )
    p.add_argument(
        "--stream-interval",
        type=runtime.positive_int,
        default=1,
        help="decode steps between a stream's events, as SGLang's (1: an event per token)",
    )
    p.add_argument("--model-path", default="openai/gpt-oss-120b")
    p.add_argument("--served-model-name", default=None, help="defaults to --model-path")
    p.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument(
        "--tp-size",
        "--tp",
        type=runtime.positive_int,
        default=1,
        help="GPUs one worker spans; >1 scales the GPU's model ideally (not calibrated: see core/gpus.py)",
    )
    p.add_argument("--quantization", default=None, help="reported in /server_info, as SGLang does")
    cache = p.add_argument_group("prefix cache (SGLang's RadixAttention, emulated per worker)")
    cache.add_argument("--disable-radix-cache", action="store_true", help="no prefix caching, as SGLang's flag")
    cache.add_argument(
        "--page-size",
        type=runtime.positive_int,
        default=None,
        help="tokens per KV page: hits and inserts are whole pages (default: 1, SGLang's on AMD GPUs)",
    )
    cache.add_argument(
        "--schedule-policy",
        default="fcfs",
        help=f"admission order: {', '.join(SCHEDULE_POLICIES)} (default: fcfs, as SGLang's)",
    )
    cache.add_argument(
        "--radix-eviction-policy", default="lru", help="which cached prefix goes first: lru only (SGLang's default)"
    )
    cache.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="sort the waiting queue by each request's priority (fcfs or lof only), and let a waiting request "
        "preempt running ones of a lower priority when the batch is full",
    )
    cache.add_argument("--schedule-low-priority-values-first", action="store_true", help="as SGLang's")
    cache.add_argument("--default-priority-value", type=int, default=None, help="as SGLang's")
    cache.add_argument("--disable-priority-preemption", action="store_true", help="as SGLang's")
    cache.add_argument(
        "--priority-scheduling-preemption-threshold",
        type=int,
        default=10,
        help="as SGLang's: a waiting request preempts running ones whose priority is more than this below its own",
    )
    cache.add_argument(
        "--abort-on-priority-when-disabled",
        action="store_true",
        help="not emulated: refused (SGLang aborts a request naming a priority with 503)",
    )
    cache.add_argument(
        "--swa-full-tokens-ratio",
        type=runtime.positive_float,
        default=SWA_FULL_TOKENS_RATIO,
        help="the sliding-window KV pool's size over the full one's (default: 0.8, as SGLang's)",
    )
    cache.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="OpenAI usage carries prompt_tokens_details.cached_tokens, as SGLang's flag",
    )
    p.add_argument("--enable-metrics", action="store_true", help="accepted: this emulator always serves /metrics")
    p.add_argument(
        "--load-s",
        type=runtime.non_negative_float,
        default=os.environ.get(LOAD_ENV, "0"),
        help=f"seconds the model takes to load, during which no port answers (default: ${LOAD_ENV}, else 0)",
    )
    faults = p.add_argument_group("faults (for drills)")
    faults.add_argument(
        "--enable-faults",
        action="store_true",
        default=os.environ.get(FAULTS_ENV) == "1",
        help="serve POST /_emulator/faults and /_emulator/die, which break this worker for anyone who "
        f"reaches its port (drills only; without it they do not exist; ${FAULTS_ENV}=1 too)",
    )
    faults.add_argument("--slowdown", type=runtime.at_least_one, default=1.0, help="brownout factor")
    faults.add_argument("--unhealthy", action="store_true", help="health checks answer 503")
    faults.add_argument("--hang", action="store_true", help="accept requests, never answer")
    faults.add_argument(
        "--die-after-s",
        type=runtime.positive_float,
        default=None,
        help="close every port and reset connections after this many seconds",
    )
    args, ignored = p.parse_known_args(argv)
    args.ignored = ignored
    if args.profile is None:
        p.error(f"say the GPU to emulate: --profile, or ${GPU_ENV}")
    if args.schedule_policy not in SCHEDULE_POLICIES:
        p.error(
            f"--schedule-policy {args.schedule_policy}: SGLang accepts it, the emulator does not model it; "
            f"use one of {', '.join(SCHEDULE_POLICIES)}"
        )
    if args.enable_priority_scheduling and args.schedule_policy not in PRIORITY_POLICIES:
        p.error(priority_policy_refused(args.schedule_policy))
    if args.abort_on_priority_when_disabled:
        p.error("--abort-on-priority-when-disabled is not emulated")
    if args.radix_eviction_policy != "lru":
        p.error(f"--radix-eviction-policy {args.radix_eviction_policy}: only lru (SGLang's default) is emulated")
    if not 0 < args.port <= 65535 - args.workers + 1:
        p.error(f"--port {args.port} with --workers {args.workers} runs past port 65535")
    visible = os.environ.get("HIP_VISIBLE_DEVICES")
    if visible is not None and len([g for g in visible.split(",") if g.strip()]) < args.tp_size:
        p.error(f"--tp-size {args.tp_size} needs {args.tp_size} GPUs; HIP_VISIBLE_DEVICES={visible!r} gives fewer")
    return args


def worker_configs(args: argparse.Namespace) -> list[WorkerConfig]:
    return [
        WorkerConfig(
            profile=PROFILES[args.profile].tensor_parallel(args.tp_size),
            port=args.port + i,
            host=args.host,
            speed=args.speed,
            model_path=args.model_path,
            served_model_name=args.served_model_name or args.model_path,
            tokenizer_path=args.tokenizer_path or args.model_path,
            mean_output_tokens=args.mean_output_tokens,
            max_running_requests=args.max_running_requests,
            max_total_tokens=args.max_total_tokens,
            stream_interval=args.stream_interval,
            incremental_streaming_output=args.incremental_streaming_output,
            tp_size=args.tp_size,
            quantization=args.quantization,
            cache=CacheConfig(
                disable_radix_cache=args.disable_radix_cache,
                page_size=args.page_size or 1,
                schedule_policy=args.schedule_policy,
                swa_full_tokens_ratio=args.swa_full_tokens_ratio,
                priority=PriorityScheduling(
                    args.enable_priority_scheduling,
                    args.schedule_low_priority_values_first,
                    args.default_priority_value,
                    preemption=not args.disable_priority_preemption,
                    threshold=args.priority_scheduling_preemption_threshold,
                ),
            ),
            enable_cache_report=args.enable_cache_report,
        )
        for i in range(args.workers)
    ]


async def serve(args: argparse.Namespace) -> int:
    if args.ignored:
        log.info("emulator.flags_ignored", flags=[a for a in args.ignored if a.startswith("-")])
    if args.load_s:  # SGLang answers on no port until its model is loaded
        log.info("emulator.loading_model", model_path=args.model_path, seconds=args.load_s)
        await asyncio.sleep(args.load_s)
    tokens.synthetic_text()  # built once per machine (then read from its cache)
    tokens.count("warm up")  # the tokenizer loaded at start, as SGLang's is: no first request pays for it
    harmony.encoding()  # chats are answered in Harmony
    servers = [
        WorkerServer(
            c,
            Faults(slowdown=args.slowdown, unhealthy=args.unhealthy, hang=args.hang),
            fault_endpoints=args.enable_faults,
        )
        for c in worker_configs(args)
    ]
    stop = runtime.stop_event()
    try:
        for s in servers:
            await s.start()
    except OSError as exc:
        log.error("emulator.bind_failed", error=str(exc))
        for s in servers:
            await s.stop()
        return 1
    # What startup built (tokenizer tables, the synthetic text, the apps) lives as long as the
    # process: frozen, the collector's full passes stop walking it (at per-token pace they ran
    # often and cost a noticeable share of the CPU per stream event).
    gc.freeze()
    urls = [f"http://{args.host}:{s.config.port}" for s in servers]
    runtime.announce_ready(profile=args.profile, workers=len(urls), speed=args.speed, urls=urls)
    if args.die_after_s is not None:
        for s in servers:
            s.die_soon(args.die_after_s)
    await stop.wait()
    log.info("emulator.stopping", workers=len(servers))
    await asyncio.gather(*(s.stop() for s in servers))
    return 0


def raise_open_files_limit() -> None:
    """16 GPUs at MLPerf load hold ~16 k client connections open at once."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_open_files_limit()
    return runtime.run(serve, args)


if __name__ == "__main__":
    sys.exit(main())
