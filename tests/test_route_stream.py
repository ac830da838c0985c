"""RouteStream, the one long-lived call on which a gateway process asks a scheduler replica for
every route: answers by number, a refusal that ends only its own route, and a bound on what one
message may ask (against a running federation's scheduler, over mutual TLS, as a gateway)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from core import runtime, wire
from core.pki import Identity, Role
from federation.embedded import Federation
from federation.gateway.routestream import RouteStream

KR, US = "kr-mi300x", "us-mi355x"


def _stub(fed: Federation) -> tuple[grpc.Channel, wire.SchedulerStub]:
    assert fed.ca is not None
    channel = fed.ca.tls(Identity(Role.GATEWAY)).sync_channel(
        fed.config.scheduler_addresses[0], Identity(Role.SCHEDULER)
    )
    return channel, wire.SchedulerStub(channel)


def _call(number: int, exclude: tuple[str, ...] = ()) -> wire.RouteCall:
    """A dry run: decided, not counted, so the federation shared with other tests is unchanged."""
    return wire.RouteCall(number, wire.RouteRequest(f"rs-{number}", 500, 100, "us-west-2", exclude, dry_run=True))


@pytest.mark.timeout(60)
def test_routes_are_answered_by_number_and_a_refusal_ends_only_its_own(shared_federation) -> None:
    fed, _ = shared_federation
    first = [_call(7), _call(3), _call(11, exclude=(KR, US)), _call(5, exclude=(US,))]
    then = [_call(12)]
    channel, stub = _stub(fed)
    with channel:
        call = stub.RouteStream(iter([wire.route_calls_to_pb(first), wire.route_calls_to_pb(then)]), timeout=30)
        answers = [wire.route_answers_from_pb(message) for message in call]

    assert [[a.number for a in message] for message in answers] == [[7, 3, 11, 5], [12]]
    by_number = {a.number: a for message in answers for a in message}
    for number in (7, 3, 12):
        decision = by_number[number].decision
        assert decision is not None and decision.site in (KR, US), by_number[number]
    # Every site excluded: this route alone is refused, with the status a unary Route would end with.
    refused = by_number[11]
    assert refused.decision is None
    assert (refused.code, refused.message) == (
        grpc.StatusCode.FAILED_PRECONDITION.value[0],
        "no site is ready to serve",
    )
    decided = by_number[5].decision
    assert decided is not None and decided.site == KR


@pytest.mark.timeout(60)
def test_a_message_asking_more_routes_than_allowed_is_refused(shared_federation) -> None:
    fed, _ = shared_federation
    too_many = [_call(n) for n in range(runtime.ROUTE_CALLS_PER_MESSAGE + 1)]
    channel, stub = _stub(fed)
    with channel:
        call = stub.RouteStream(iter([wire.route_calls_to_pb(too_many)]), timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == f"at most {runtime.ROUTE_CALLS_PER_MESSAGE} routes in one message"


@pytest.mark.timeout(60)
async def test_routes_asked_together_go_in_one_message_and_one_after_a_quiet_spell_goes_at_once(
    shared_federation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway's routes, with a gather time of 0.5 s (ROUTE_GATHER_S, 2 ms in service) so the
    test does not race it: the first after a quiet spell is sent at once, alone; two asked soon
    after it wait for the rest of that time and go together; one asked long after goes at once."""
    monkeypatch.setattr(runtime, "ROUTE_GATHER_S", 0.5)
    fed, _ = shared_federation
    assert fed.ca is not None
    channel = fed.ca.tls(Identity(Role.GATEWAY)).channel(fed.config.scheduler_addresses[0], Identity(Role.SCHEDULER))
    routes = RouteStream(wire.SchedulerStub(channel))
    loop = asyncio.get_running_loop()

    async def timed(number: int) -> float:
        started = loop.time()
        decision = await routes.route(_call(number).request, 10.0)
        assert decision.site in (KR, US)
        return loop.time() - started

    try:
        assert await timed(1) < 0.4 and routes.messages_sent == 1
        second = asyncio.ensure_future(timed(2))
        await asyncio.sleep(0.1)
        waited = await asyncio.gather(second, timed(3))
        assert routes.messages_sent == 2, "the two asked within the gather time went together"
        assert waited[0] > 0.25 and waited[1] > 0.15
        await asyncio.sleep(0.6)
        assert await timed(4) < 0.4 and routes.messages_sent == 3
    finally:
        await routes.close()
        await channel.close()
