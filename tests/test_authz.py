"""Attacks on a running federation's gRPC ports, as someone on the WAN would make them: every
one is refused with the right code and a reason, logged, and changes nothing. The federation
is the embedded one (mutual TLS under the CA made for its run); the attackers hold
certificates of that CA for the wrong role or site, of another CA, or none."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from core import pki, wire
from core.mtls import INSECURE, Tls, load_tls
from core.pki import Identity, Role
from federation import admin
from federation.embedded import Federation

KR, US = "kr-mi300x", "us-mi355x"
SCHEDULER, GATEWAY, OPERATOR = Identity(Role.SCHEDULER), Identity(Role.GATEWAY), Identity(Role.OPERATOR)


def _as(fed: Federation, identity: Identity) -> Tls:
    assert fed.ca is not None
    return fed.ca.tls(identity)


def _seen(fed: Federation) -> dict[str, tuple[wire.SiteStatus, int]]:
    """What an attack must not change: each site's status and how many requests went to it."""
    state, _ = admin.replicas_state(fed.config.scheduler_addresses, fed.operator)
    assert state is not None
    return {s.name: (s.status, s.routed_requests) for s in state.sites}


def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    assert refused.value.code() is code, refused.value.details()
    return refused.value.details() or ""


@pytest.mark.timeout(120)
def test_wrong_roles_wrong_sites_other_cas_and_plaintext_are_refused_and_change_nothing(
    make_federation, tmp_path: Path, capfd
) -> None:
    fed, _ = make_federation()
    scheduler = fed.config.scheduler_addresses[0]
    kr_agent = f"{fed.config.host}:{next(s.agent_port for s in fed.config.sites if s.name == KR)}"
    before = _seen(fed)
    route = wire.route_request_to_pb(wire.RouteRequest("attack", 100, 100, "us-west-2"))

    with _as(fed, Identity(Role.SITE, KR)).sync_channel(scheduler, SCHEDULER) as channel:
        stub = wire.SchedulerStub(channel)
        # A site registering as another site.
        impostor = wire.SiteRegistration(US, "us-west-2", "mi355x", 4, kr_agent, fed.config.model)
        why = _refused(
            lambda: stub.RegisterSite(wire.registration_to_pb(impostor), timeout=10), grpc.StatusCode.PERMISSION_DENIED
        )
        assert why == f"site:{KR} may act only as site '{KR}', not '{US}'"
        # A site reporting as another site (each report says whose it is).
        report = wire.SiteReport(site=US, healthy_workers=0, total_workers=4)
        call = stub.Report(iter([wire.report_to_pb(report)]), timeout=10)
        why = _refused(lambda: list(call), grpc.StatusCode.PERMISSION_DENIED)
        assert why == f"site:{KR} may act only as site '{KR}', not '{US}'"
        # A site making routes (making another site look busy) or removing one.
        _refused(lambda: stub.Route(route, timeout=10), grpc.StatusCode.PERMISSION_DENIED)
        routes = wire.route_calls_to_pb([wire.RouteCall(1, wire.route_request_from_pb(route))])
        call = stub.RouteStream(iter([routes]), timeout=10)
        why = _refused(lambda: list(call), grpc.StatusCode.PERMISSION_DENIED)
        assert why == f"site:{KR} may not call RouteStream"
        _refused(lambda: stub.RemoveSite(wire.site_ref_to_pb(US), timeout=10), grpc.StatusCode.PERMISSION_DENIED)

    with _as(fed, GATEWAY).sync_channel(scheduler, SCHEDULER) as channel:
        stub = wire.SchedulerStub(channel)
        for method in (stub.RemoveSite, stub.DrainSite):
            why = _refused(lambda m=method: m(wire.site_ref_to_pb(US), timeout=10), grpc.StatusCode.PERMISSION_DENIED)
            assert why.startswith("gateway may not call ")

    with _as(fed, OPERATOR).sync_channel(kr_agent, Identity(Role.SITE, KR)) as channel:
        # An operator (or anyone but a gateway) asking an agent for tokens.
        command = wire.generate_command_to_pb([], [1])
        call = wire.SiteAgentStub(channel).Generate(iter([command]), timeout=10)
        why = _refused(lambda: list(call), grpc.StatusCode.PERMISSION_DENIED)
        assert why == "operator may not call Generate"

    # A certificate of another CA, and no certificate at all: no connection.
    other = pki.init_ca(tmp_path / "other-ca")
    cert, key = pki.issue(other, OPERATOR, tmp_path / "other")
    strangers = [load_tls(other / pki.CA_CERT, cert, key, OPERATOR), INSECURE]
    for stranger in strangers:
        for address in (scheduler, kr_agent):
            with stranger.sync_channel(address, SCHEDULER) as channel:
                _refused(
                    lambda c=channel: wire.SchedulerStub(c).GetState(wire.state_request_to_pb(), timeout=5),
                    grpc.StatusCode.UNAVAILABLE,
                )

    assert _seen(fed) == before
    logged = capfd.readouterr().err
    assert logged.count('"event": "rpc.refused"') >= 7, logged[-2000:]
