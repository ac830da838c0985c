"""`python -m scheduler --port 50051 --model openai/gpt-oss-120b --ca CA --cert CERT --key KEY [--rtt-ms A:B=130 ...]`

Serves mutual TLS with a `scheduler` certificate and takes each call only from the roles that
may make it (`core.authz`); `--insecure` serves plaintext instead, and then sites join only with
the credential in `--join-token-file`, when one is given (a file of mode 0600: neither a flag's
value, which every user of the machine sees, nor the environment, which every child inherits)."""

from __future__ import annotations

import argparse
import sys

import grpc
import structlog

from core import credential, deployment, metrics_endpoint, mtls, runtime, tracing, unreadable, wire
from core.authz import Guard
from core.pki import SCHEDULER
from core.policy import POLICIES
from core.settings import SchedulerTimings, add_timings_argument
from scheduler import spans
from scheduler.service import SchedulerService

log = structlog.get_logger("scheduler")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler", description="The federation's global scheduler.")
    deployment.add_config_argument(p, replica=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--model", default="openai/gpt-oss-120b", help="the model every site must serve")
    p.add_argument("--tokenizer", default="", help="the tokenizer every site must use (default: the model's)")
    p.add_argument(
        "--checkpoint",
        action="append",
        default=None,
        help="a checkpoint of --model that sites may load, in its own weight format (its tokenizer must be "
        "the same), repeatable; default: the model's own and those of the built-in recipes (core/recipes.py)",
    )
    p.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default="least_expected_delay",
        help="routing policy; the others are baselines for benchmarks",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port of --host (HTTPS, operators' certificates only; HTTP with --insecure)",
    )
    p.add_argument("--rtt-ms", type=runtime.rtt_arg, action="append", default=[], help="REGION:REGION=MS, repeatable")
    add_timings_argument(p, SchedulerTimings)
    mtls.add_arguments(p, "scheduler")
    credential.add_argument(p)
    args = p.parse_args(argv)
    args.tls = mtls.from_arguments(p, args, SCHEDULER)
    args.join_credential = credential.from_arguments(p, args)
    return args


async def serve(args: argparse.Namespace) -> int:
    tracing.configure("scheduler")
    rtt = runtime.rtt_map(args.rtt_ms)
    service = SchedulerService(
        args.model,
        rtt,
        args.policy,
        tokenizer=args.tokenizer,
        checkpoints=args.checkpoint,
        join_credential=args.join_credential,
        timings=args.timings,
        guard=Guard(args.tls),
    )
    server = grpc.aio.server(
        options=runtime.GRPC_SERVER_OPTIONS, interceptors=[unreadable.Refuse(), *spans.interceptors()]
    )
    wire.add_scheduler_to_server(service, server)
    address = f"{args.host}:{args.port}"
    mtls.warn_if_insecure(args.tls, log)
    try:
        args.tls.listen(server, address)
    except RuntimeError as exc:
        log.error("scheduler.bind_failed", address=address, error=str(exc))
        return 1
    try:
        metrics = await metrics_endpoint.serve_asked(service.metrics.registry, args, "scheduler")
    except OSError:
        return 1
    await server.start()
    expiry = service.start_expiry()
    stop = runtime.stop_event()
    runtime.announce_ready(scheduler=address, **metrics_endpoint.announced(args.host, args.metrics_port, args.tls))
    await stop.wait()
    expiry.cancel()
    if metrics is not None:
        await metrics.cleanup()
    await server.stop(args.timings.shutdown_grace_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(deployment.expand(sys.argv[1:] if argv is None else argv, "scheduler"))
    return runtime.run(serve, args)


if __name__ == "__main__":
    sys.exit(main())
