"""`python -m federation.gateway --port 8080 --scheduler 127.0.0.1:50051 --scheduler 127.0.0.1:50052 --ca CA --cert CERT --key KEY`

Dials the schedulers and the sites' agents over mutual TLS with a `gateway` certificate (each
must hold the certificate of what it was dialled as), or plaintext with `--insecure`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import structlog
from aiohttp import web

from core import deployment, harmony, mtls, runtime, tiers, tokens, tracing
from core.pki import GATEWAY
from core.policy import POLICIES
from core.settings import GatewayTimings, add_timings_argument
from federation.gateway import metrics
from federation.gateway.admission import MAX_HELD
from federation.gateway.app import GatewayConfig, build_admin_app, build_app
from federation.gateway.edge import EdgeLimits, EdgeSite, runner_options
from federation.gateway.failover import FailoverConfig
from federation.gateway.keys import KeyFileError, Keys
from federation.gateway.keystore import region_store

log = structlog.get_logger("gateway")
OPEN_WARNING = "OPEN ENDPOINT (no --api-keys): anyone who reaches the port may use it, without limits"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m federation.gateway", description="The federation's endpoint.")
    deployment.add_config_argument(p, replica=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--open",
        action="store_true",
        help="serve without --api-keys on an address other than loopback (refused otherwise: anyone who "
        "reaches the port could use it)",
    )
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--scheduler", action="append", required=True, help="host:port of a scheduler replica; repeat for each"
    )
    p.add_argument("--model", default="openai/gpt-oss-120b")
    p.add_argument("--reuse-port", action="store_true", help="share the port with other gateway processes")
    p.add_argument(
        "--ttft-budget-ms",
        type=float,
        default=0.0,
        help="latency mode: hold or refuse (429) requests no site can start within this (0: throughput mode)",
    )
    p.add_argument("--max-held", type=int, default=MAX_HELD, help="requests held for a site in latency mode, at most")
    p.add_argument(
        "--patience-s",
        type=runtime.patience_arg,
        action="append",
        default=None,
        help="TIER=SECONDS, repeatable: in throughput mode, refuse (429) a request of that service tier that no "
        "site would start within SECONDS (0: no bound; default: flex=60, the others unbounded)",
    )
    p.add_argument(
        "--retry-budget-s",
        type=runtime.positive_float,
        default=None,
        help="how long a request may wait for another site after a failure (default: the timings', 30 s)",
    )
    p.add_argument("--no-resume", action="store_true", help="fail a stream cut mid-answer instead of resuming it")
    p.add_argument("--policy", choices=sorted(POLICIES), default="least_expected_delay", help="for degraded mode")
    p.add_argument(
        "--rtt-ms",
        type=runtime.rtt_arg,
        action="append",
        default=[],
        help="REGION:REGION=MS, repeatable: the schedulers' round trips, for decisions made here "
        "(degraded mode, held requests)",
    )
    p.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        help="the keys file (`fedctl keys add`): every API request needs one of its keys, within its limits "
        "(default: an open endpoint, said loudly at start)",
    )
    p.add_argument(
        "--limits-db",
        type=Path,
        default=None,
        help="the SQLite file where gateway processes sharing the port keep the keys' limits "
        f"(default: limits.sqlite in ${metrics.MULTIPROCESS_DIR_ENV} when set, else this process's memory)",
    )
    p.add_argument(
        "--quota-store",
        action="append",
        default=[],
        metavar="REGION=URL",
        help="a region's quota store (redis://HOST:PORT/DB), repeatable, this gateway's region's among them: the "
        "keys (`fedctl keys --redis`) and their limits, held across every gateway of every region "
        "(docs/QUOTAS.md; instead of --api-keys)",
    )
    p.add_argument("--region", default="", help="this gateway's region (its store is --quota-store REGION=URL)")
    p.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="serve /health and /metrics on this port (same host) and not on --port",
    )
    edge = EdgeLimits()
    p.add_argument(
        "--idle-timeout-s",
        type=runtime.positive_float,
        default=edge.idle_timeout_s,
        help="close a client connection idle this long, or whose request head has not all arrived by then",
    )
    p.add_argument(
        "--body-timeout-s",
        type=runtime.positive_float,
        default=edge.body_timeout_s,
        help="answer 408 to a request whose body has not all arrived this long after its head",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=runtime.non_negative_int,
        default=edge.max_connections_per_address,
        help="open connections one client address may hold; more are answered 429 and closed (0: no cap; "
        "behind a load balancer every client is its address)",
    )
    add_timings_argument(p, GatewayTimings)
    mtls.add_arguments(p, "gateway")
    args = p.parse_args(argv)
    args.tls = mtls.from_arguments(p, args, GATEWAY)
    args.edge = EdgeLimits(args.idle_timeout_s, args.max_connections_per_address, args.body_timeout_s)
    args.quota_stores = {}
    for given in args.quota_store:
        try:
            region, url = region_store(given)
        except ValueError as exc:
            p.error(f"--quota-store {exc}")
        args.quota_stores[region] = url
    if args.quota_stores and args.region not in args.quota_stores:
        p.error(
            f"--region {args.region!r} has no --quota-store: give --region and --quota-store {args.region or 'R'}=URL"
        )
    if args.quota_stores and args.api_keys is not None:
        p.error("--api-keys and --quota-store: the keys are in one or the other, not both")
    if args.api_keys is not None:
        try:
            Keys(args.api_keys)
        except KeyFileError as exc:
            p.error(str(exc))
    elif not args.quota_stores and not args.open and not runtime.is_loopback(args.host):
        p.error(
            f"--host {args.host} serves beyond this machine, and without --api-keys anyone who reaches the port "
            "may use it: give --api-keys FILE (`fedctl keys add`), or --open to serve anyone on purpose"
        )
    if args.limits_db is None and os.environ.get(metrics.MULTIPROCESS_DIR_ENV):
        args.limits_db = Path(os.environ[metrics.MULTIPROCESS_DIR_ENV]) / "limits.sqlite"
    if args.retry_budget_s is not None:
        args.timings = dataclasses.replace(args.timings, retry_budget_s=args.retry_budget_s)
    return args


async def serve(args: argparse.Namespace) -> int:
    tracing.configure("gateway")
    tokens.count("warm up")  # load the tokenizer before the first request pays for it
    harmony.encoding()  # and Harmony's, for chats
    failover = FailoverConfig(retry_budget_s=args.timings.retry_budget_s, resume=not args.no_resume)
    config = GatewayConfig(
        tuple(args.scheduler),
        args.model,
        ttft_budget_ms=args.ttft_budget_ms,
        max_held=args.max_held,
        patience_s=tiers.PATIENCE_S if args.patience_s is None else {**tiers.PATIENCE_S, **dict(args.patience_s)},
        failover=failover,
        policy=args.policy,
        rtt_s=runtime.rtt_map(args.rtt_ms),
        timings=args.timings,
        tls=args.tls,
        api_keys=args.api_keys,
        limits_db=args.limits_db,
        region=args.region,
        quota_stores=args.quota_stores,
        admin_routes=args.admin_port is None,
        edge=args.edge,
    )
    mtls.warn_if_insecure(args.tls, log)
    if args.api_keys is None and not args.quota_stores:
        log.warning("gateway.open", warning=OPEN_WARNING)
    app = build_app(config)
    # Cancel a handler when its client disconnects, so the site's work is aborted too.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=args.timings.shutdown_grace_s,
        **runner_options(args.edge),
    )
    await runner.setup()
    runners = [runner]
    try:
        await EdgeSite(
            runner,
            args.host,
            args.port,
            max_per_address=args.edge.max_connections_per_address,
            reuse_port=args.reuse_port,
        ).start()
        if args.admin_port is not None:
            runners.append(web.AppRunner(build_admin_app(app), access_log=None, **runner_options(args.edge)))
            await runners[-1].setup()
            await web.TCPSite(
                runners[-1], args.host, args.admin_port, reuse_address=True, reuse_port=args.reuse_port
            ).start()  # processes sharing the API's port share the admin one too
    except OSError as exc:
        log.error("gateway.bind_failed", host=args.host, port=args.port, admin_port=args.admin_port, error=str(exc))
        for started in reversed(runners):
            await started.cleanup()
        return 1
    stop = runtime.stop_event()
    admin = {"admin": f"http://{args.host}:{args.admin_port}"} if args.admin_port is not None else {}
    runtime.announce_ready(gateway=f"http://{args.host}:{args.port}", **admin)
    await stop.wait()
    for started in reversed(runners):
        await started.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(deployment.expand(sys.argv[1:] if argv is None else argv, "federation.gateway"))
    return runtime.run(serve, args)


if __name__ == "__main__":
    sys.exit(main())
