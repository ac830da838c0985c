"""`python -m nodes.agent`: the site agent in front of one site's SGLang workers.

    python -m nodes.agent --site us-mi355x --region us-west-2 --gpu mi355x --gpus 16 \\
        --port 50062 --scheduler 127.0.0.1:50051 --emulate --speed 0.1
    python -m nodes.agent ... --worker-url http://gpu-host-1:30000 --worker-url ...

With `--emulate` it launches an emulator process with one worker per GPU and owns it. It
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

import aiohttp
import grpc
import structlog

from core import credential, metrics_endpoint, mtls, runtime, tracing, unreadable, wire
from core.authz import Guard
from core.pki import Identity, Role
from core.settings import AgentTimings, add_timings_argument
from nodes.agent import calibrate
from nodes.agent.join import JoinGate
from nodes.agent.pool import WorkerPool
from nodes.agent.reporter import ReportFeed
from nodes.agent.service import SiteAgentService
from nodes.emulator.launch import EmulatorProcess, launch

log = structlog.get_logger("agent")
# SGLang's default stream repeats the whole answer in every event: a 100 k-token answer is ~1 MB a line.
CUMULATIVE_EVENT_BYTES = 8 * 1024**2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m nodes.agent", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    p.add_argument(
        "--coalesce-ms",
        type=runtime.positive_float,
        default=None,
        help="how long a stream's tokens gather before they go to the gateway: the cadence of the chunks "
        "clients see (default 100 ms; the first token and the end go at once; see nodes/agent/relay.py)",
    )
    p.add_argument("--speed", type=float, default=1.0, help="emulated GPU speed (with --emulate)")
    p.add_argument("--emulator-port", type=int, default=None, help="first worker port (with --emulate)")
    p.add_argument(
        "--emulator-stream-interval",
        type=runtime.positive_int,
        default=1,
        help="decode steps between a stream's events, as SGLang's --stream-interval (with --emulate)",
    )
    p.add_argument(
        "--emulator-enable-faults",
        action="store_true",
        help="the emulated workers serve their drill faults (with --emulate; see the emulator's --enable-faults)",
    )
    add_timings_argument(p, AgentTimings)
    mtls.add_arguments(p, "site")
    credential.add_argument(p)
    args = p.parse_args(argv)
    args.join_credential = credential.from_arguments(p, args)
    args.tls = mtls.from_arguments(p, args, Identity(Role.SITE, args.site))
    if args.gpus < 1:
        p.error("--gpus must be >= 1")
    if args.coalesce_ms is not None:
        args.timings = dataclasses.replace(args.timings, coalesce_s=args.coalesce_ms / 1000)
    return args


async def serve(args: argparse.Namespace) -> int:
    tracing.configure("agent", **{tracing.SITE: args.site})
    emulator: EmulatorProcess | None = None
    if args.emulate:
        emulator = await asyncio.to_thread(
            launch,
            [
                "--profile",
                args.gpu,
                "--workers",
                str(args.gpus),
                "--speed",
                str(args.speed),
                "--served-model-name",
                args.model,
                "--incremental-streaming-output",  # deltas: no answer repeated in every event
                *("--stream-interval", str(args.emulator_stream_interval)),
                *(["--enable-faults"] if args.emulator_enable_faults else []),
            ],
            port=args.emulator_port,
        )
    urls = emulator.urls if emulator else args.worker_url
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


async def _serve_site(args: argparse.Namespace, urls: list[str], session: aiohttp.ClientSession) -> int:
    pool = WorkerPool(urls, session, args.timings)
    await pool.check_all()
    address = f"{args.host}:{args.port}"
    gate = JoinGate(args.site, args.region, args.gpu, args.gpus, args.join_credential, args.scheduler or [])
    service = SiteAgentService(args.site, pool, session, gate, args.advertise or address, Guard(args.tls))
    server = grpc.aio.server(options=runtime.GRPC_SERVER_OPTIONS, interceptors=[unreadable.Refuse()])
    wire.add_site_agent_to_server(service, server)
    mtls.warn_if_insecure(args.tls, log)
    try:
        args.tls.listen(server, address)
    except RuntimeError as exc:
        log.error("agent.bind_failed", address=address, error=str(exc))
        return 1
    served = _what_workers_serve(pool, args.model)
    if served is None:
        return 1
    try:
        metrics = await metrics_endpoint.serve_asked(service.metrics.registry, args, "agent")
    except OSError:
        return 1
    announced = metrics_endpoint.announced(args.host, args.metrics_port, args.tls)
    await server.start()
    tasks = [asyncio.ensure_future(pool.check_forever()), asyncio.ensure_future(service.watch_calls())]
    stop = asyncio.ensure_future(runtime.stop_event().wait())
    waits = not gate.schedulers.done()
    if waits:  # ready to be joined: serving, not yet probed or reporting
        runtime.announce_ready(site=args.site, agent=address, workers=urls, joined=False, **announced)
        log.info("agent.waiting_to_join", site=args.site, agent=address)
    await asyncio.wait([stop, gate.schedulers], return_when=asyncio.FIRST_COMPLETED)
    reporter: ReportFeed | None = None
    if not stop.done():
        reporter = ReportFeed(
            await _registration(args, pool, service.address, *served),
            service.next_report,
            args.join_credential,
            args.timings,
            args.tls,
        )
        reporter.start(list(gate.schedulers.result()))
        if not waits:  # ready once probed and reporting, as it was started to be
            runtime.announce_ready(site=args.site, agent=address, workers=urls, joined=True, **announced)
        tasks.append(asyncio.ensure_future(reporter.feed_forever()))
        await asyncio.wait([stop, tasks[-1]], return_when=asyncio.FIRST_COMPLETED)
    log.info("agent.stopping", site=args.site)
    stopped = stop.done()  # else the reporter died
    for task in (*tasks, stop):
        task.cancel()
    await asyncio.gather(*tasks, stop, return_exceptions=True)
    if reporter is not None:
        await asyncio.to_thread(reporter.stop)
    await server.stop(args.timings.shutdown_grace_s)
    await service.close()
    if metrics is not None:
        await metrics.cleanup()
    return 0 if stopped else 1


async def _registration(
    args: argparse.Namespace, pool: WorkerPool, address: str, model: str, tokenizer: str
) -> wire.SiteRegistration:
    """What the site registers with, the calibration probe run now that it joins."""
    measured = await calibrate.probe(pool)
    return wire.SiteRegistration(
        args.site,
        args.region,
        args.gpu,
        args.gpus,
        address,
        model,
        *((measured.batch, measured.context_tokens, measured.tok_s) if measured else (0.0, 0.0, 0.0)),
        tokenizer=tokenizer,
    )


def _what_workers_serve(pool: WorkerPool, declared_model: str) -> tuple[str, str] | None:
    """(model, tokenizer) as the workers say they serve them: what the site registers, so the
    schedulers check what the site really runs, not what it was told to run. None when the
    workers disagree (a site must serve one model)."""
    infos = [w.info for w in pool.workers if w.info is not None]
    models = {i.served_model for i in infos if i.served_model}
    tokenizers = {i.tokenizer for i in infos if i.tokenizer}
    if len(models) > 1 or len(tokenizers) > 1:
        log.error("agent.workers_disagree", models=sorted(models), tokenizers=sorted(tokenizers))
        return None
    return next(iter(models), declared_model), next(iter(tokenizers), "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return runtime.run(serve, args)


if __name__ == "__main__":
    sys.exit(main())
