"""What one route costs on the wire with no gateway around it: RouteStream round trips to a
scheduler replica, from a bare client holding the gateway's certificate, each a dry run (decided,
not counted). First one at a time with the loops idle in between (the latency a request's route
pays at best), then back to back (the scheduler's CPU per route, from psutil). The floor under
`scripts/hop_idle.py`'s hop (docs/BENCHMARKS.md). Against `fedctl up` (its certificates are in
`/tmp/inference-federation-PORT.tls`):

    python3 scripts/route_rtt.py --tls-dir /tmp/inference-federation-8080.tls [--scheduler 127.0.0.1:50051]
"""

import argparse
import asyncio
import statistics
import time
import uuid
from pathlib import Path

import psutil
import uvloop

from core import pki, wire
from core.mtls import Tls


def _listening_on(port: int) -> psutil.Process:
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise SystemExit(f"nothing of this user's listens on port {port}")


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def main(scheduler: str, tls_dir: Path, requests: int) -> None:
    creds = pki.load(tls_dir / "ca.crt", tls_dir / "gateway.crt", tls_dir / "gateway.key")
    call = wire.SchedulerStub(Tls(creds).channel(scheduler, pki.SCHEDULER)).RouteStream()
    request = wire.RouteRequest("req-" + uuid.uuid4().hex, 1000, 4, dry_run=True)

    async def route(number: int) -> None:
        await call.write(wire.route_calls_to_pb([wire.RouteCall(number, request, ())]))
        (answer,) = wire.route_answers_from_pb(await call.read())
        if answer.decision is None:
            raise SystemExit(f"the scheduler decided no site: {answer.message}")

    await route(0)  # the call opened
    took = []
    for number in range(1, requests + 1):
        started = time.perf_counter()
        await route(number)
        took.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.02)  # one at a time, with the loops idle in between
    cuts = statistics.quantiles(took, n=10)
    print(
        f"one at a time: {requests} routes, p10 {cuts[0]:.2f} / p50 {statistics.median(took):.2f} / p90 {cuts[-1]:.2f} ms"
    )
    server = _listening_on(int(scheduler.rsplit(":", 1)[1]))
    cpu, mine, started = _cpu_s(server), time.process_time(), time.perf_counter()
    for number in range(requests + 1, 11 * requests + 1):
        await route(number)
    n = 10 * requests
    print(
        f"back to back: {n} routes, {(time.perf_counter() - started) / n * 1000:.2f} ms each; CPU per route: "
        f"scheduler {(_cpu_s(server) - cpu) / n * 1e6:.0f} µs, this client {(time.process_time() - mine) / n * 1e6:.0f} µs"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", default="127.0.0.1:50051")
    parser.add_argument("--tls-dir", type=Path, required=True, help="where `fedctl up` keeps its certificates")
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    uvloop.run(main(args.scheduler, args.tls_dir, args.requests))
