"""`python -m nodes.agent`: the site agent in front of one site's SGLang workers.

    python -m nodes.agent --site us-mi355x --region us-west-2 --gpu mi355x --gpus 8 \\
        --port 50062 --scheduler 10.0.0.5:50051 --launch sglang [--recipes recipes.yaml]
    python -m nodes.agent ... --worker-url http://gpu-host-1:30000 --worker-url ...
    python -m nodes.agent ... --emulate --speed 0.1

With `--launch sglang` it starts the site's SGLang workers itself, one `sglang.launch_server`
per `gpus_per_worker` GPUs of its GPU type's recipe (core/recipes.py; `--recipes` replaces the
built-in ones), and supervises them (nodes/agent/launcher.py): the site registers at once and
stays joining while they load its model; it serves once one is up and probed. `--launch
emulator` runs the same command lines with the emulator instead of SGLang (what `fedctl up`
does). With `--worker-url` it fronts workers started by someone else. With `--emulate` it
launches one emulator process with one worker per GPU (the benches' economy). It
registers the model and tokenizer its workers say they serve. It serves and dials mutual TLS
with its site's certificate (`--ca/--cert/--key`, from `fedctl ca issue --site NAME`): the
schedulers take it as that site only, and it takes Generate calls only from gateways and Join
calls only from operators. `--insecure` runs plaintext instead, presenting the join credential
in `--join-token-file` (mode 0600) when the federation has one. Started without `--scheduler`, it serves
and waits until `fedctl site add --agent HOST:PORT` (presenting that credential) names them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import structlog

from core import (
    credential,
    deployment,
    metrics_endpoint,
    mtls,
    recipes,
    runtime,
    supervise,
    tracing,
    unreadable,
    wire,
)
from core.authz import Guard
from core.pki import Identity, Role
from core.processes import free_port_block
from core.settings import AgentTimings, add_timings_argument
from nodes.agent import calibrate
from nodes.agent.join import JoinGate
from nodes.agent.launcher import Launcher
from nodes.agent.pool import WorkerPool
from nodes.agent.readers import MAX_READERS, ReaderPool
from nodes.agent.reporter import ReportFeed
from nodes.agent.service import SiteAgentService
from nodes.emulator import __main__ as emulator_main
from nodes.emulator.launch import EmulatorProcess, launch

log = structlog.get_logger("agent")
LAUNCHED_HOST = "127.0.0.1"  # launched workers answer the agent only, on its host
# SGLang's default stream repeats the whole answer in every event: a 100 k-token answer is ~1 MB a line.
CUMULATIVE_EVENT_BYTES = 8 * 1024**2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m nodes.agent", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    deployment.add_config_argument(p)
    p.add_argument("--site", required=True)
    p.add_argument("--region", required=True)
    p.add_argument("--gpu", required=True, choices=["mi300x", "mi355x"])
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--model", default="openai/gpt-oss-120b")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port of --host (HTTPS, operators' certificates only; HTTP with --insecure)",
    )
    p.add_argument("--advertise", default=None, help="host:port gateways dial (default host:port)")
    p.add_argument(
        "--scheduler",
        action="append",
        default=None,
        help="host:port, repeatable; without it the agent waits for `fedctl site add --agent` to name them",
    )
    workers = p.add_mutually_exclusive_group(required=True)
    workers.add_argument("--worker-url", action="append", help="an SGLang worker, repeatable")
    workers.add_argument("--emulate", action="store_true", help="launch emulated workers, one per GPU")
    workers.add_argument(
        "--launch",
        choices=sorted(recipes.PROGRAMS),
        help="start the site's workers from its GPU's recipe, with SGLang or the emulator, and supervise them",
    )
    p.add_argument(
        "--recipes",
        type=Path,
        default=None,
        help="a YAML file whose `recipes:` (by GPU type) replace the built-in ones (with --launch or --emulate)",
    )
    p.add_argument(
        "--coalesce-ms",
        type=runtime.positive_float,
        default=None,
        help="how long a stream's tokens gather before they go to the gateway: the cadence of the chunks "
        "clients see (default 100 ms; the first token and the end go at once; see nodes/agent/relay.py)",
    )
    p.add_argument(
        "--readers",
        type=runtime.non_negative_int,
        default=0,
        help="processes that read the workers' streams beside this one (default 0: it reads them itself); "
        "one core reads the tokens of only a few MI355X at SGLang's pace, so a bigger site needs them "
        "(how many a core reads: docs/DATAPATH.md; nodes/agent/readers.py)",
    )
    p.add_argument(
        "--speed",
        type=runtime.positive_float,
        default=1.0,
        help="the GPUs' clock speed (default 1: real GPUs): the emulated workers' speed with --emulate or "
        "--launch emulator; declared to the schedulers with the GPUs, so that the site's prior and the bound "
        "on its measured capacity are in the time its tokens come in (pass the workers' --speed when "
        "attaching emulated ones)",
    )
    p.add_argument(
        "--worker-port",
        "--emulator-port",
        dest="worker_port",
        type=int,
        default=None,
        help="first worker port (with --launch or --emulate; default: a free block)",
    )
    p.add_argument(
        "--first-gpu",
        type=runtime.non_negative_int,
        default=0,
        help="with --launch: the host's first GPU the workers take (HIP_VISIBLE_DEVICES counts from it), "
        "so that a host's GPUs can be split between the agents of several sites (docs/DATAPATH.md)",
    )
    p.add_argument(
        "--emulator-load-s",
        type=runtime.non_negative_float,
        default=0.0,
        help="seconds an emulated worker takes to load its model (with --launch emulator)",
    )
    p.add_argument(
        "--emulator-stream-interval",
        type=runtime.positive_int,
        default=1,
        help="decode steps between a stream's events, as SGLang's --stream-interval (with --emulate)",
    )
    p.add_argument(
        "--emulator-enable-faults",
        action="store_true",
        help="the emulated workers serve their drill faults (with --emulate, --launch emulator; see the "
        "emulator's --enable-faults)",
    )
    add_timings_argument(p, AgentTimings)
    mtls.add_arguments(p, "site")
    credential.add_argument(p)
    args = p.parse_args(argv)
    args.join_credential = credential.from_arguments(p, args)
    args.tls = mtls.from_arguments(p, args, Identity(Role.SITE, args.site))
    if args.gpus < 1:
        p.error("--gpus must be >= 1")
    if args.readers > MAX_READERS:
        p.error(f"--readers must be <= {MAX_READERS}")
    if args.first_gpu and not args.launch:
        p.error("--first-gpu needs --launch (other workers are the ones given or emulated)")
    try:
        args.recipe = recipes.load_recipes(args.recipes)[args.gpu]
        args.recipe.workers(args.gpus)
    except recipes.RecipeError as exc:
        p.error(str(exc))
    if args.coalesce_ms is not None:
        args.timings = dataclasses.replace(args.timings, coalesce_s=args.coalesce_ms / 1000)
    return args


async def serve(args: argparse.Namespace) -> int:
    tracing.configure("agent", **{tracing.SITE: args.site})
    emulator: EmulatorProcess | None = None
    recipe = args.recipe
    if args.emulate:
        emulator = await asyncio.to_thread(
            launch,
            [
                *("--profile", args.gpu, "--workers", str(args.gpus), "--speed", str(args.speed)),
                *("--model-path", recipe.model_path, "--served-model-name", args.model),
                *("--tokenizer-path", recipe.tokenizer_path or args.model),
                "--incremental-streaming-output",  # deltas: no answer repeated in every event
                "--enable-cache-report",  # as every recipe's workers (core/recipes.py)
                *("--stream-interval", str(args.emulator_stream_interval)),
                *(["--enable-faults"] if args.emulator_enable_faults else []),
            ],
            port=args.worker_port,
        )
        urls = emulator.urls
    elif args.launch:
        args.worker_port = args.worker_port or free_port_block(recipe.workers(args.gpus))
        urls = Launcher.urls(recipe, args.gpus, LAUNCHED_HOST, args.worker_port)
    else:
        urls = args.worker_url
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=args.timings.connect_timeout_s)  # answers take minutes
    try:
        async with aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0),
            read_bufsize=CUMULATIVE_EVENT_BYTES,
        ) as session:
            return await _serve_site(args, urls, session)
    finally:
        if emulator is not None:
            await asyncio.to_thread(emulator.stop)


@dataclasses.dataclass(frozen=True, slots=True)
class Serves:
    """What the site serves, as it registers it."""

    model: str
    tokenizer: str
    checkpoint: str
    weight_format: str


async def _serve_site(args: argparse.Namespace, urls: list[str], session: aiohttp.ClientSession) -> int:
    recipe = args.recipe
    launched = args.launch is not None
    own = Serves(args.model, recipe.tokenizer_path or args.model, recipe.model_path, recipe.weight_format)
    pool = WorkerPool(urls, session, args.timings, (own.model, own.tokenizer) if launched else None)
    address = f"{args.host}:{args.port}"
    gate = JoinGate(args.site, args.region, args.gpu, args.gpus, args.join_credential, args.scheduler or [])
    readers = ReaderPool(args.readers, args.timings) if args.readers else None
    if readers is not None:
        await readers.open()
    service = SiteAgentService(args.site, pool, session, gate, args.advertise or address, Guard(args.tls), readers)
    launcher: Launcher | None = None
    if launched:
        emulated = {} if args.launch == "sglang" else _emulator_env(args)
        launcher = Launcher(
            recipe,
            args.launch,
            args.model,
            LAUNCHED_HOST,
            args.worker_port,
            pool,
            args.timings,
            emulated,
            args.first_gpu,
        )
        launcher.on_restart = service.metrics.worker_restarts.inc
        launcher.start()
        service.starting = True
    else:
        await pool.check_all()
    try:
        served = own if launched or args.emulate else _what_workers_serve(pool, args.model)
        if served is None:
            return 1
        return await _serve_joined(args, pool, service, served, address)
    finally:
        if launcher is not None:
            await launcher.stop()


async def _serve_joined(
    args: argparse.Namespace, pool: WorkerPool, service: SiteAgentService, served: Serves, address: str
) -> int:
    """Serve Generate and Join, register and report once joined, until stopped."""
    server = grpc.aio.server(options=runtime.GRPC_SERVER_OPTIONS, interceptors=[unreadable.Refuse()])
    wire.add_site_agent_to_server(service, server)
    mtls.warn_if_insecure(args.tls, log)
    try:
        args.tls.listen(server, address)
    except RuntimeError as exc:
        log.error("agent.bind_failed", address=address, error=str(exc))
        return 1
    try:
        metrics = await metrics_endpoint.serve_asked(service.metrics.registry, args, "agent")
    except OSError:
        return 1
    announced = metrics_endpoint.announced(args.host, args.metrics_port, args.tls)
    await server.start()
    gate = service.gate
    urls = [w.url for w in pool.workers]
    supervisor = supervise.Supervisor()
    tasks = [
        supervise.restarting("agent.check_workers", pool.check_forever),
        supervise.restarting("agent.watch_calls", service.watch_calls),
    ]
    stop = asyncio.ensure_future(runtime.stop_event().wait())
    failed = asyncio.ensure_future(supervisor.failed.wait())
    reporter: ReportFeed | None = None
    try:  # stopped, failed or cancelled: everything below is stopped in turn
        waits = not gate.schedulers.done()
        if waits:  # ready to be joined: serving, not yet probed or reporting
            runtime.announce_ready(site=args.site, agent=address, workers=urls, joined=False, **announced)
            log.info("agent.waiting_to_join", site=args.site, agent=address)
        joined: list[asyncio.Future[Any]] = [stop, gate.schedulers]
        await asyncio.wait(joined, return_when=asyncio.FIRST_COMPLETED)
        if not stop.done():
            # Launched workers are still loading: the site registers now (joining), and again with
            # its probe once one is up (`_probe_when_up`); others were probed before it registers.
            measured = None if service.starting else await calibrate.probe(pool)
            registration = _registration(args, service.address, served, measured)
            reporter = ReportFeed(registration, service.next_report, args.join_credential, args.timings, args.tls)
            reporter.start(list(gate.schedulers.result()))
            if not waits:  # ready once reporting, as it was started to be
                runtime.announce_ready(site=args.site, agent=address, workers=urls, joined=True, **announced)
            supervisor.essential("agent.report", reporter.feed_forever())
            if service.starting:
                supervisor.essential("agent.probe_when_up", _probe_when_up(args, pool, service, reporter, served))
            await asyncio.wait([stop, failed], return_when=asyncio.FIRST_COMPLETED)
    finally:
        log.info("agent.stopping", site=args.site)
        for task in (*tasks, stop, failed):
            task.cancel()
        await asyncio.gather(*tasks, stop, failed, return_exceptions=True)
        await supervisor.close()
        if reporter is not None:
            await asyncio.to_thread(reporter.stop)
        await server.stop(args.timings.shutdown_grace_s)
        await service.close()
        if metrics is not None:
            await metrics.cleanup()
    return supervisor.exit_code


async def _probe_when_up(
    args: argparse.Namespace, pool: WorkerPool, service: SiteAgentService, reporter: ReportFeed, served: Serves
) -> None:
    """Launched workers: once one is up, the join probe runs on those up, the site registers
    again with what it measured, and serves."""
    await pool.any_healthy.wait()
    measured = await calibrate.probe(pool)
    reporter.reregister(_registration(args, service.address, served, measured))
    service.starting = False
    log.info("agent.workers_up", site=args.site, healthy=pool.healthy_count, of=len(pool.workers))


def _registration(
    args: argparse.Namespace, address: str, served: Serves, measured: calibrate.ProbeResult | None
) -> wire.SiteRegistration:
    return wire.SiteRegistration(
        args.site,
        args.region,
        args.gpu,
        args.gpus,
        address,
        served.model,
        *((measured.batch, measured.context_tokens, measured.tok_s) if measured else (0.0, 0.0, 0.0)),
        tokenizer=served.tokenizer,
        checkpoint=served.checkpoint,
        weight_format=served.weight_format,
        clock_speed=args.speed,
    )


def _emulator_env(args: argparse.Namespace) -> dict[str, str]:
    """What an emulated worker learns from its machine (nodes/emulator/__main__.py)."""
    return {
        emulator_main.GPU_ENV: args.gpu,
        emulator_main.SPEED_ENV: str(args.speed),
        emulator_main.LOAD_ENV: str(args.emulator_load_s),
        emulator_main.FAULTS_ENV: "1" if args.emulator_enable_faults else "0",
    }


def _what_workers_serve(pool: WorkerPool, declared_model: str) -> Serves | None:
    """What the workers say they serve: what the site registers, so the schedulers check what
    the site really runs, not what it was told to run. None when the workers disagree (a site
    must serve one model from one checkpoint)."""
    infos = [w.info for w in pool.workers if w.info is not None]
    said = {
        "models": {i.served_model for i in infos if i.served_model},
        "tokenizers": {i.tokenizer for i in infos if i.tokenizer},
        "checkpoints": {i.checkpoint for i in infos if i.checkpoint},
        "formats": {i.quantization for i in infos},
    }
    if any(len(values) > 1 for values in said.values()):
        log.error("agent.workers_disagree", **{k: sorted(v) for k, v in said.items()})
        return None
    model = next(iter(said["models"]), declared_model)
    return Serves(
        model, next(iter(said["tokenizers"]), ""), next(iter(said["checkpoints"]), ""), next(iter(said["formats"]), "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(deployment.expand(sys.argv[1:] if argv is None else argv, "nodes.agent"))
    return runtime.run(serve, args)


if __name__ == "__main__":
    sys.exit(main())
