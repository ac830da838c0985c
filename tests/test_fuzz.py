"""The fuzz run against a running federation (mutual TLS, the tests' small Korea + US one) while
valid streamed chats flow: generated HTTP requests at the gateway and gRPC calls at a scheduler
replica and an agent. No 5xx, no call ending in an unhandled error, no process dead, every valid
chat answered in full. A smoke of `fedctl fuzz` (10,000 and 1,000 per service, ~100 s: too long
for CI, run and recorded in docs/SECURITY.md): 1,000 HTTP requests and 150 calls per service."""

from __future__ import annotations

import json

import pytest

from federation import fuzz


@pytest.mark.timeout(300)
def test_hostile_requests_break_nothing(make_federation) -> None:
    fed, _ = make_federation()
    report = fuzz.run(fuzz.target(fed), http_n=1_000, grpc_n=150)
    summary = json.dumps(report, indent=1)[:6000]
    assert report["http"]["sent"] >= 1_000 and report["http"]["failed"] == 0, summary
    for service in ("Scheduler", "SiteAgent"):
        assert report["grpc"][service]["sent"] >= 150 and report["grpc"][service]["failed"] == 0, summary
    assert report["dead_processes"] == [], summary
    assert report["valid"]["failed"] == 0 and report["valid"]["outcomes"]["answered"] > 0, summary
    assert report["passed"]
    # The generated requests reached past the door: bodies were read and judged, methods ran.
    assert report["http"]["outcomes"].get("400", 0) > 100 and report["http"]["outcomes"].get("200", 0) > 100
    assert report["grpc"]["Scheduler"]["outcomes"].get("OK", 0) > 15
    assert report["grpc"]["SiteAgent"]["outcomes"].get("INVALID_ARGUMENT", 0) > 5
