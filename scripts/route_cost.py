"""`python3 scripts/route_cost.py --sites 1024`: what one scheduler replica's work costs in CPU at
N sites, in process, without sockets: a Route decision (with prefix hashes), a site report
applied, a report parsed, the federation's state built for GetState, and a state pushed to
WatchState's watchers. The world is
`fedctl simulate`'s (federation/simulate/world.py), each site reporting what its GPU model
holds after a few seconds of load. Prints one JSON line; docs/BENCHMARKS.md cites it.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from core import wire
from federation.simulate.site import Request, SiteModel
from federation.simulate.world import make_sites, rtt_s
from scheduler.service import SchedulerService

MODEL = "openai/gpt-oss-120b"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sites", type=int, default=1024)
    p.add_argument("--routes", type=int, default=2000)
    args = p.parse_args()
    service = SchedulerService(MODEL, rtt_s())
    world = make_sites(args.sites, 0, 0.3)
    rng = random.Random(0)
    models = {}
    for s in world:
        service.registry.register(wire.SiteRegistration(s.name, s.region, s.gpu, s.gpus, "127.0.0.1:1", MODEL))
        model = models[s.name] = SiteModel(s, lambda a, b: 0.0)
        for i in range(model.slots):
            model.send(Request(i, s.region, rng.randint(200, 2000), rng.randint(100, 3000), 1278, 0.0), 0.0)
        model.tick(0.0, 5.0)

    def report(s, at: float) -> wire.SiteReport:
        m = models[s.name]
        return wire.SiteReport(
            site=s.name,
            healthy_workers=s.gpus,
            total_workers=s.gpus,
            running_requests=m.running,
            context_tokens=m.context_tokens,
            slots=m.slots,
            outstanding_requests=m.held,
            outstanding_tokens=m.outstanding_tokens(),
            work=m.work_done(),
            accounting_workers=s.gpus,
        )

    now = time.monotonic()
    for k in range(8):
        for s in world:
            service.registry.apply_report(report(s, now), now + k * 0.25)
    requests = [
        wire.RouteRequest(
            f"r{i}",
            rng.randint(100, 3000),
            1000,
            client_region=rng.choice(world).region,
            prefix_hashes=tuple(rng.getrandbits(64) for _ in range(16)),
        )
        for i in range(args.routes)
    ]
    out: dict[str, float] = {"sites": args.sites}
    started = time.process_time()
    for r in requests:
        service._decide(r)
    out["route_ms"] = 1e3 * (time.process_time() - started) / len(requests)
    reports = [report(s, now) for s in world]
    started = time.process_time()
    for k in range(4):
        for r in reports:
            service.registry.apply_report(r, now + 3 + k * 0.25)
    out["apply_report_us"] = 1e6 * (time.process_time() - started) / (4 * len(reports))
    encoded = [wire.report_to_pb(r).SerializeToString() for r in reports]
    parse = type(wire.report_to_pb(reports[0])).FromString
    started = time.process_time()
    for b in encoded:
        wire.report_from_pb(parse(b))
    out["parse_report_us"] = 1e6 * (time.process_time() - started) / len(encoded)
    started = time.process_time()
    for _ in range(10):
        wire.federation_state_to_pb(service._state()).SerializeToString()
    out["state_ms"] = 1e3 * (time.process_time() - started) / 10
    # A push to watchers (WatchState) a tenth of a second after the last, in which a quarter of
    # the sites reported (each every 0.41 s at 1,024 sites): only theirs are built anew.
    service._state_to_push()
    spent = 0.0
    for k in range(10):
        for r in reports[k % 4 :: 4]:
            service.registry.apply_report(r, now + 5 + k * 0.1)
        started = time.process_time()
        service._state_to_push().SerializeToString()
        spent += time.process_time() - started
    out["push_ms"] = 1e3 * spent / 10
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))


if __name__ == "__main__":
    main()
